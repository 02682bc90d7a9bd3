// Double-precision reference for RoPE, written as Hugging Face writes it:
//   q_embed = q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x[h:], x[:h])
// (half-split style) or with rotate_half acting on interleaved pairs (-x[2i+1], x[2i]) (GPT-J).
// An odd rotary_dim r = 2n + 1 (Liger-Kernel's rule; Hugging Face's formula has none): the same
// formula on the 2n paired channels, the last channel (2n) passed through, and the table row
// 2 * ceil(r / 2) = 2n + 2 wide as Hugging Face's rotary embedding builds it: the half-split style
// reads channel d < n at cos[d] and channel n + d at cos[n + 1 + d] (the second half of the row).
// The backward is the transpose of the same linear map, formed explicitly.
#pragma once

#include <cstdint>
#include <vector>

namespace tigon_ref {

// The table entry of channel d (d < 2 * (rotary_dim / 2)).
inline int rope_table_index(int d, int rotary_dim, bool interleaved) {
  const int h = rotary_dim / 2;
  return interleaved || d < h ? d : d + rotary_dim % 2;
}

// One head vector x[0:head_dim] with its table row (cos, sin)[0:2 * ceil(rotary_dim / 2)].
inline std::vector<double> rope_head(const double* x, const double* cos, const double* sin,
                                     int head_dim, int rotary_dim, bool interleaved) {
  const int h = rotary_dim / 2, paired = 2 * h;
  std::vector<double> rot(paired), y(x, x + head_dim);
  for (int d = 0; d < paired; ++d) {
    if (!interleaved) {
      rot[d] = d < h ? -x[d + h] : x[d - h];
    } else {
      rot[d] = d % 2 == 0 ? -x[d + 1] : x[d - 1];
    }
  }
  for (int d = 0; d < paired; ++d) {
    const int e = rope_table_index(d, rotary_dim, interleaved);
    y[d] = x[d] * cos[e] + rot[d] * sin[e];
  }
  return y;
}

// Transpose of rope_head's map applied to dy: dx[j] = sum_i dy[i] * d y_i / d x_j.
inline std::vector<double> rope_head_backward(const double* dy, const double* cos, const double* sin,
                                              int head_dim, int rotary_dim, bool interleaved) {
  std::vector<double> dx(dy, dy + head_dim);
  const int h = rotary_dim / 2, paired = 2 * h;
  for (int j = 0; j < paired; ++j) {
    double v = dy[j] * cos[rope_table_index(j, rotary_dim, interleaved)];
    int i;        // the output that reads x_j through rotate_half
    double sign;  // the sign rotate_half gives x_j there
    if (!interleaved) {
      i = j < h ? j + h : j - h;
      sign = j < h ? 1.0 : -1.0;
    } else {
      i = j % 2 == 0 ? j + 1 : j - 1;
      sign = j % 2 == 0 ? 1.0 : -1.0;
    }
    v += dy[i] * sign * sin[rope_table_index(i, rotary_dim, interleaved)];
    dx[j] = v;
  }
  return dx;
}

}  // namespace tigon_ref
