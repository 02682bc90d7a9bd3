// Double-precision reference for RoPE, written as Hugging Face writes it:
//   q_embed = q * cos + rotate_half(q) * sin,  rotate_half(x) = cat(-x[h:], x[:h])
// (half-split style) or with rotate_half acting on interleaved pairs (-x[2i+1], x[2i]) (GPT-J).
// The backward is the transpose of the same linear map, formed explicitly.
#pragma once

#include <cstdint>
#include <vector>

namespace tigon_ref {

// One head vector x[0:head_dim] with its table row (cos, sin)[0:rotary_dim].
inline std::vector<double> rope_head(const double* x, const double* cos, const double* sin,
                                     int head_dim, int rotary_dim, bool interleaved) {
  std::vector<double> rot(rotary_dim), y(x, x + head_dim);
  const int h = rotary_dim / 2;
  for (int d = 0; d < rotary_dim; ++d) {
    if (!interleaved) {
      rot[d] = d < h ? -x[d + h] : x[d - h];
    } else {
      rot[d] = d % 2 == 0 ? -x[d + 1] : x[d - 1];
    }
  }
  for (int d = 0; d < rotary_dim; ++d) y[d] = x[d] * cos[d] + rot[d] * sin[d];
  return y;
}

// Transpose of rope_head's map applied to dy: dx[j] = sum_i dy[i] * d y_i / d x_j.
inline std::vector<double> rope_head_backward(const double* dy, const double* cos, const double* sin,
                                              int head_dim, int rotary_dim, bool interleaved) {
  std::vector<double> dx(dy, dy + head_dim);
  const int h = rotary_dim / 2;
  for (int j = 0; j < rotary_dim; ++j) {
    double v = dy[j] * cos[j];
    int i;        // the output that reads x_j through rotate_half
    double sign;  // the sign rotate_half gives x_j there
    if (!interleaved) {
      i = j < h ? j + h : j - h;
      sign = j < h ? 1.0 : -1.0;
    } else {
      i = j % 2 == 0 ? j + 1 : j - 1;
      sign = j % 2 == 0 ? 1.0 : -1.0;
    }
    v += dy[i] * sign * sin[i];
    dx[j] = v;
  }
  return dx;
}

}  // namespace tigon_ref
