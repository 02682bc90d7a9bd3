"""Reference implementations of tigon's operators on the CPU, written from the math in tigon's headers
and docs (fp32 arithmetic, roundings where tigon makes them), for the test suite's reference mode:

    TIGON_TORCH_REFERENCE_OPS=1 python -m pytest examples/torch/tests

runs the GPU tests on the CPU with these in place of tigon's kernels. That checks the Python side
(layouts, strides, argument plumbing, the patches, the autograd wiring) and the tests themselves on
a machine without a GPU. It says nothing about tigon's kernels: on a GPU the suite runs them.
The operator schemas must be loaded (the pip-built extension or a JIT build).
"""

from __future__ import annotations

import torch

_LIB = None


def _rms_forward(xf, r, w, offset, casting, dtype):
    if casting == 2:  # none: rstd, the normalised x and (offset + w) each rounded to T
        n = (xf * r.to(dtype).float()[:, None]).to(dtype).float()
        s = (offset + w.float()).to(dtype).float() if w is not None else 1.0
        return n * s
    n = xf * r[:, None]
    if casting == 0:  # llama: the normalised x rounded to T
        n = n.to(dtype).float()
    s = (offset + w.float()) if w is not None else 1.0
    return n * s


def rms_norm_fwd(x, weight, y, rstd, eps, offset, casting):
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y.copy_(_rms_forward(xf, r, weight, offset, casting, x.dtype).to(y.dtype))
    if rstd is not None:
        rstd.copy_(r)


def _rms_backward(dy, x, weight, rstd, eps, offset, casting):
    xf, dyf = x.float(), dy.float()
    r = rstd if rstd is not None else torch.rsqrt(xf.pow(2).mean(-1) + eps)
    xhat = xf * r[:, None]
    dn = dyf * (offset + weight.float()) if weight is not None else dyf
    dx = r[:, None] * (dn - xhat * (dn * xhat).mean(-1, keepdim=True))
    term = xhat if casting == 1 else xhat.to(x.dtype).float()
    dw = (dyf * term).sum(0)
    return dx, dw


def rms_norm_bwd(dy, x, weight, rstd, dx, dweight, eps, offset, casting):
    g, gw = _rms_backward(dy, x, weight, rstd, eps, offset, casting)
    dx.copy_(g.to(dx.dtype))
    if dweight is not None:
        dweight.copy_(gw.to(dweight.dtype))


def layer_norm_fwd(x, weight, bias, y, mean, rstd, eps):
    xf = x.float()
    m = xf.mean(-1)
    r = torch.rsqrt((xf - m[:, None]).pow(2).mean(-1) + eps)
    out = (xf - m[:, None]) * r[:, None]
    if weight is not None:
        out = out * weight.float()
    if bias is not None:
        out = out + bias.float()
    y.copy_(out.to(y.dtype))
    mean.copy_(m)
    rstd.copy_(r)


def layer_norm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias):
    xf, dyf = x.float(), dy.float()
    xhat = (xf - mean[:, None]) * rstd[:, None]
    g = dyf * weight.float() if weight is not None else dyf
    out = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dx.copy_(out.to(dx.dtype))
    if dweight is not None:
        dweight.copy_((dyf * xhat).sum(0).to(dweight.dtype))
    if dbias is not None:
        dbias.copy_(dyf.sum(0).to(dbias.dtype))


def add_rms_norm_fwd(x, residual, weight, y, sum, rstd, eps, offset, casting):
    s = (x.float() + residual.float()).to(x.dtype)
    sf = s.float()
    r = torch.rsqrt(sf.pow(2).mean(-1) + eps)
    out = _rms_forward(sf, r, weight, offset, casting, x.dtype).to(y.dtype)
    sum.copy_(s)
    y.copy_(out)
    if rstd is not None:
        rstd.copy_(r)


def add_rms_norm_bwd(dy, dsum, sum, weight, rstd, dx, dweight, eps, offset, casting):
    g, gw = _rms_backward(dy, sum, weight, rstd, eps, offset, casting)
    if dsum is not None:
        g = g + dsum.float()
    dx.copy_(g.to(dx.dtype))
    if dweight is not None:
        dweight.copy_(gw.to(dweight.dtype))


def _rope_one(x, out, cos, sin, pos, backward, interleaved):
    b, t, h, d = x.shape
    w = cos.shape[-1]
    rd = d if w == d + 1 and d % 2 == 1 else w  # an odd head_dim's table is head_dim + 1 wide
    if not 2 <= rd <= d:
        raise ValueError(f"tigon.rope: cos / sin width {w} must be in [2, head_dim] (head_dim {d}), "
                         "or head_dim + 1 for an odd head_dim")
    n = rd // 2  # pairs; an odd rd's last channel passes through
    if pos is not None:
        bi = torch.arange(b)[:, None] if cos.shape[0] > 1 else torch.zeros(b, 1, dtype=torch.long)
        c, s = cos[bi, pos.long()], sin[bi, pos.long()]
    else:
        c, s = cos[:, :t], sin[:, :t]
    c, s = c[:, :, None, :].float(), s[:, :, None, :].float()
    xr = x[..., :2 * n].float()
    if interleaved:
        i, j = slice(0, 2 * n, 2), slice(1, 2 * n, 2)
        ti, tj = i, j
    else:  # the second members' table entries: the second half of the row, from rd - n
        i, j = slice(0, n), slice(n, 2 * n)
        ti, tj = i, slice(rd - n, rd)
    xi, xj, ci, cj, si, sj = xr[..., i], xr[..., j], c[..., ti], c[..., tj], s[..., ti], s[..., tj]
    if not backward:
        yi, yj = ci * xi - si * xj, cj * xj + sj * xi
    else:
        yi, yj = ci * xi + sj * xj, cj * xj - si * xi
    y = torch.empty_like(xr)
    y[..., i], y[..., j] = yi, yj
    out[..., :2 * n] = y.to(out.dtype)
    out[..., 2 * n:] = x[..., 2 * n:]


def _mrope_table(t, sections):
    """Hugging Face's composed M-RoPE row: column j from the plane of pair j mod (width / 2)'s
    section ([3, batch, rows, width] -> [batch, rows, width])."""
    if len(sections) != 3 or t.dim() != 4 or t.shape[0] != 3 or 2 * sum(sections) != t.shape[-1]:
        raise ValueError(f"tigon.rope: sections {list(sections)} need cos / sin [3, batch, rows, 2 * sum], "
                         f"got {tuple(t.shape)}")
    parts = t.split(list(sections) * 2, dim=-1)
    return torch.cat([m[i % 3] for i, m in enumerate(parts)], dim=-1)


def rope(q, k, cos, sin, position_ids, q_out, k_out, backward, interleaved, sections=()):
    if sections:
        cos, sin = _mrope_table(cos, sections), _mrope_table(sin, sections)
    _rope_one(q, q_out, cos, sin, position_ids, backward, interleaved)
    if k is not None:
        _rope_one(k, k_out, cos, sin, position_ids, backward, interleaved)


def _act(act, a):
    if act == 0:
        return torch.nn.functional.silu(a)
    return torch.nn.functional.gelu(a, approximate="tanh" if act == 1 else "none")


def _round(x, dtype):
    """x rounded to dtype and back to fp32: an intermediate tensor of the module's dtype."""
    return x.to(dtype).float()


def gated_fwd(a, b, c, act, gate_multiplier, down_multiplier):
    out = down_multiplier * _round(_act(act, gate_multiplier * a.float()), a.dtype) * b.float()
    c.copy_(out.to(c.dtype))


def _act_derivative(act, a):
    if act == 0:
        sg = torch.sigmoid(a)
        return sg * (1 + a * (1 - sg))
    if act == 1:
        beta, kappa = 0.7978845608028654, 0.044715
        t = torch.tanh(beta * (a + kappa * a**3))
        return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * beta * (1 + 3 * kappa * a * a)
    cdf = 0.5 * (1 + torch.erf(a * 0.7071067811865476))
    return cdf + a * 0.3989422804014327 * torch.exp(-0.5 * a * a)


def gated_bwd(dc, a, b, da, db, act, gate_multiplier, down_multiplier):
    z = gate_multiplier * a.float()
    g = dc.float() * down_multiplier
    ga = _round(g * b.float(), a.dtype) * gate_multiplier * _act_derivative(act, z)
    gb = g * _round(_act(act, z), a.dtype)
    da.copy_(ga.to(da.dtype))
    db.copy_(gb.to(db.dtype))


def relu2_fwd(a, c):
    r = torch.relu(a.float())
    c.copy_((r * r).to(c.dtype))


def relu2_bwd(dc, a, da):
    r = torch.relu(a.float())  # autograd's relu then square: the gradient passes where r is not <= 0
    da.copy_(torch.where(r <= 0, torch.zeros_like(r), dc.float() * (2 * r)).to(da.dtype))


def _ce(x, target, class_weights, grad_output, ignore_index, smoothing, z, cap, reduction, grad_scale,
        token_scaling=False):
    """Rows' losses, the reduced loss and z part, lse, argmax and, when grad_scale is given, dloss/dlogits
    (times grad_scale and grad_output), from logits x [rows, vocab]; tigon's formulas in fp32. Token scaling:
    each row's loss, z part and gradient times its (constant) probability of the target."""
    x = x.float()
    xc = cap * torch.tanh(x / cap) if cap > 0 else x
    vocab = x.shape[1]
    valid = target != ignore_index
    t = torch.where(valid, target, torch.zeros_like(target)).long()
    w = class_weights.float() if class_weights is not None else torch.ones(vocab, device=x.device)
    lse = torch.logsumexp(xc, -1)
    xt = xc.gather(1, t[:, None])[:, 0]
    wt = w[t]
    sum_w = w.sum()
    smooth = (lse * sum_w - (xc * w).sum(-1)) / vocab
    zero = torch.zeros_like(lse)
    f = torch.exp(xt - lse) if token_scaling else torch.ones_like(lse)
    rows = torch.where(valid, ((1 - smoothing) * wt * (lse - xt) + smoothing * smooth + z * lse * lse) * f, zero)
    zrows = torch.where(valid, z * lse * lse * f, zero)
    if reduction == 2:  # the cross-entropy part over the weight sum, the z part over the token count
        denom = (wt * valid).sum() if class_weights is not None else valid.sum().float()
        # A weight sum of 0 (every target weighs 0, or all are ignored): that part and its gradient are 0.
        ce_scale = torch.where(denom != 0, 1 / torch.where(denom != 0, denom, torch.ones_like(denom)),
                               torch.zeros_like(denom))
        count = valid.sum().float().clamp_min(1)
        ztotal = zrows.sum() / count
        total = (rows - zrows).sum() * ce_scale + ztotal
    else:
        ce_scale = count = torch.ones((), device=x.device)
        total, ztotal = rows.sum(), zrows.sum()
    grad = None
    if grad_scale is not None:
        p = torch.exp(xc - lse[:, None])
        onehot = torch.zeros_like(p).scatter_(1, t[:, None], 1.0)
        d = ((1 - smoothing) * wt[:, None] * (p - onehot) + smoothing / vocab * (p * sum_w - w)) * ce_scale \
            + 2 * z * lse[:, None] * p / count
        if cap > 0:
            d = d * (1 - (xc / cap) ** 2)
        go = grad_output.float() if grad_output is not None else torch.ones((), device=x.device)
        go = go.reshape(-1, 1) if reduction == 0 else go.reshape(())
        grad = d * (valid * f)[:, None] * go * grad_scale
    return rows, total, ztotal, lse, xc.argmax(-1), grad


def cross_entropy(logits, target, class_weights, grad_output, dlogits, loss, loss_rows, z_loss, lse, argmax,
                  ignore_index, label_smoothing, z_loss_scale, softcap, reduction, grad_scale):
    rows, total, ztotal, l, am, grad = _ce(logits, target, class_weights, grad_output, ignore_index, label_smoothing,
                                           z_loss_scale, softcap, reduction,
                                           grad_scale if dlogits is not None else None)
    for out, val in ((loss, total), (loss_rows, rows), (z_loss, ztotal), (lse, l), (argmax, am)):
        if out is not None:
            out.copy_(val.reshape(out.shape))
    if dlogits is not None:
        dlogits.copy_(grad.to(dlogits.dtype))


def linear_cross_entropy(x, weight, bias, target, class_weights, grad_output, dx, dweight, dbias, loss, loss_rows,
                         z_loss, lse, argmax, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
                         grad_scale, token_scaling, chunk):
    logits = x.float() @ weight.float().t()
    if bias is not None:  # added in the GEMM's epilogue, before its one rounding
        logits = logits + bias.float()
    logits = logits.to(x.dtype)  # the GEMM's output in the inputs' dtype
    want_grad = dx is not None or dweight is not None or dbias is not None
    rows, total, ztotal, l, am, grad = _ce(logits, target, class_weights, grad_output, ignore_index, label_smoothing,
                                           z_loss_scale, softcap, reduction, grad_scale if want_grad else None,
                                           token_scaling=token_scaling)
    for out, val in ((loss, total), (loss_rows, rows), (z_loss, ztotal), (lse, l), (argmax, am)):
        if out is not None:
            out.copy_(val.reshape(out.shape))
    if want_grad:
        g = grad.to(x.dtype).float()  # dlogits in the inputs' dtype, as the chunk buffer holds them
        if dx is not None:
            dx.copy_((g @ weight.float()).to(dx.dtype))
        if dweight is not None:
            dweight.copy_(g.t() @ x.float())
        if dbias is not None:
            dbias.copy_(g.sum(0))


def linear_cross_entropy_heads(x, weights, biases, targets, class_weights, grad_output, head_weights, dx, dweights,
                               dbiases, loss, head_losses, loss_rows, z_loss, ignore_index, label_smoothing,
                               z_loss_scale, softcap, reduction, grad_scale, chunk):
    heads, rows = targets.shape
    total = ztot = 0.0
    dx_sum = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if dx is not None else None
    for k in range(heads):
        go = grad_output
        if go is not None and reduction == 0:
            go = go.reshape(heads, rows)[k]
        hk = torch.empty((), dtype=torch.float32, device=x.device)
        zk = torch.empty((), dtype=torch.float32, device=x.device)
        rk = torch.empty(rows, dtype=torch.float32, device=x.device) if loss_rows is not None else None
        dxk = torch.empty_like(x) if dx is not None else None
        linear_cross_entropy(x, weights[k], biases[k] if biases else None, targets[k], class_weights, go, dxk,
                             dweights[k] if dweights else None, dbiases[k] if dbiases else None,
                             hk if reduction != 0 else None, rk, zk if reduction != 0 else None, None, None,
                             ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
                             grad_scale * head_weights[k], False, chunk)
        if dx is not None:
            dx_sum += dxk.float()
        if rk is not None:
            loss_rows.reshape(heads, rows)[k].copy_(rk)
        if reduction != 0:
            if head_losses is not None:
                head_losses[k] = hk
            total = total + head_weights[k] * hk
            ztot = ztot + head_weights[k] * zk
    if dx is not None:
        dx.copy_(dx_sum.to(dx.dtype))
    if loss is not None:
        loss.copy_(torch.as_tensor(total).reshape(loss.shape))
    if z_loss is not None:
        z_loss.copy_(torch.as_tensor(ztot).reshape(z_loss.shape))


def _llp_logits(x, weight, bias, temperature):
    """The linear log-prob op's logits in fp32: the GEMM's output in the inputs' dtype (the bias added before
    its one rounding), over the temperature."""
    logits = x.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    logits = logits.to(x.dtype)
    return logits.float(), logits.float() / temperature


def linear_logprob(x, weight, bias, target, logp, lse, entropy, logit_sum, error_count, ignore_index, temperature,
                   chunk, kept=None, is_top1=None):
    raw, z = _llp_logits(x, weight, bias, temperature)
    vocab = z.shape[1]
    valid = (target != ignore_index) & (target >= 0) & (target < vocab)
    if error_count is not None:
        error_count += ((target != ignore_index) & ~valid).sum().to(error_count.dtype)
    l = torch.logsumexp(z, dim=-1)
    lp = torch.log_softmax(z, dim=-1)
    t = torch.where(valid, target, torch.zeros_like(target))
    zero = torch.zeros_like(l)
    vals = {"logp": torch.where(valid, lp.gather(1, t[:, None])[:, 0], zero), "lse": torch.where(valid, l, zero),
            "entropy": torch.where(valid, -(lp.exp() * lp).sum(-1), zero),
            "logit_sum": raw.sum(-1)}
    for name, out in (("logp", logp), ("lse", lse), ("entropy", entropy), ("logit_sum", logit_sum)):
        if out is not None:
            out.copy_(vals[name])
    if is_top1 is not None:  # the first argmax (torch.argmax takes the first maximum) is the target
        is_top1.copy_(valid & (raw.argmax(-1) == t))


def linear_logprob_bwd(x, weight, bias, target, lse, entropy, grad_logp, grad_entropy, dx, dweight, dbias,
                       ignore_index, temperature, chunk, accumulate, kept=None):
    _, z = _llp_logits(x, weight, bias, temperature)
    vocab = z.shape[1]
    valid = (target != ignore_index) & (target >= 0) & (target < vocab)
    p = torch.exp(z - lse[:, None])
    g = grad_logp if grad_logp is not None else torch.zeros_like(lse)
    h = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
    mean_z = lse - (entropy if entropy is not None else torch.zeros_like(lse))
    t = torch.where(valid, target, torch.zeros_like(target))
    onehot = torch.nn.functional.one_hot(t, vocab).float()
    d = (g[:, None] * onehot - p * (g[:, None] + h[:, None] * (z - mean_z[:, None]))) / temperature
    d = torch.where(valid[:, None], d, torch.zeros_like(d)).to(x.dtype).float()  # dlogits in the inputs' dtype
    if dx is not None:
        dx.copy_((d @ weight.float()).to(dx.dtype))
    for out, val in ((dweight, d.t() @ x.float()), (dbias, d.sum(0))):
        if out is not None:
            out.copy_(out + val if accumulate else val)


def scale_rows(x, scale):
    s = scale.reshape(-1, 1).float()
    x.copy_(torch.where(s == 1.0, x.float(), x.float() * s).to(x.dtype))


def target_range(target, ignore_index):
    ignored = target == ignore_index
    t = target.masked_fill(ignored, 0)
    return [min(int(t.min()), 0), max(int(t.max()), 0), int((~ignored).sum())] if t.numel() else [0, 0, 0]


def _div_forms(v, form, temperature):
    """(log-probabilities, probabilities) of one side given in form 0 (log-probs), 1 (probs), 2 (logits)."""
    if form == 0:
        return v, torch.exp(v)
    if form == 1:
        return torch.log(v), v
    lg = torch.log_softmax(v / temperature, dim=-1)
    return lg, torch.exp(lg)


def _div_elements(kind, xl, xp, yl, yp, student_input, teacher_input, beta, eps):
    """Each element's loss and its gradient with respect to the student's log-probability (kinds 0, 1) or
    probability (kind 2), with tigon's conventions: an element whose weighting probability is 0 gives 0."""
    zero = torch.zeros_like(xl)
    if kind == 0:
        if beta == 0.0:  # forward KL
            return torch.where(yp != 0, yp * (yl - xl), zero), -yp
        if beta == 1.0:  # reverse KL
            loss = torch.where(xp != 0, xp * (xl - yl), zero)
            return loss, torch.where(xp != 0, loss + xp, zero)
        bp, bq = beta * yp, (1.0 - beta) * xp
        m = bp + bq
        log_m = torch.log(m)
        loss = torch.where(bp != 0, bp * yl, zero) + torch.where(bq != 0, bq * xl, zero) - torch.where(
            m != 0, m * log_m, zero)
        return loss, torch.where(bq != 0, bq * (xl - log_m), zero)
    if kind == 1:
        if teacher_input == 1:  # probabilities, clamped to eps inside the log
            loss = torch.where(yp != 0, yp * (torch.log(torch.clamp(yp, min=eps)) - xl), zero)
        else:
            loss = torch.where(yp != 0, yp * (yl - xl), zero)
        return loss, -yp
    d = xp - yp
    return 0.5 * d.abs(), torch.where(d > 0, torch.full_like(d, 0.5), torch.full_like(d, -0.5))


def divergence(student, teacher, labels, grad_output, dx, loss, loss_rows, loss_elems, kind, student_input,
               teacher_input, reduction, ignore_index, beta, eps, temperature, grad_scale):
    """tigon.divergence (docs/divergence.md): elements in fp32, the loss sums in fp64 (where tigon adds in
    fp32 in a fixed tree order, which loses less than a CPU's sequential fp32 sum), the gradient rounded
    once to the student's dtype."""
    if kind not in (0, 1, 2):
        raise ValueError(f"tigon.divergence: kind must be 0, 1 or 2, got {kind}")
    accepted = {0: ((0, 0), (2, 2)), 1: ((0, 1), (0, 0)), 2: ((1, 1),)}[kind]
    if (student_input, teacher_input) not in accepted:
        raise NotImplementedError(f"tigon.divergence: input forms ({student_input}, {teacher_input}) for kind {kind}")
    if kind == 0 and not 0.0 <= beta <= 1.0:
        raise ValueError(f"tigon.divergence: beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"tigon.divergence: temperature must be > 0, got {temperature}")
    if teacher.shape[-1] != student.shape[-1]:
        raise ValueError("tigon.divergence: the teacher's vocabulary differs from the student's")
    rows, vocab = student.shape
    if rows == 0:
        if loss is not None:
            loss.zero_()
        return
    xl, xp = _div_forms(student.float(), student_input, temperature)
    yl, yp = _div_forms(teacher.float(), teacher_input, temperature)
    el, g = _div_elements(kind, xl, xp, yl, yp, student_input, teacher_input, beta, eps)
    if kind == 2 and student_input != 1:
        g = g * xp
    valid = labels != ignore_index if labels is not None else torch.ones(rows, dtype=torch.bool)
    el = torch.where(valid[:, None], el, torch.zeros_like(el))
    g = torch.where(valid[:, None], g, torch.zeros_like(g))
    row_sums = el.double().sum(-1)
    count = float(valid.sum()) if labels is not None else float(rows)
    den = {3: count, 2: count * vocab}.get(reduction, 1.0)
    if loss is not None:
        loss.copy_(torch.tensor(0.0 if den == 0 else float(row_sums.sum()) / den).reshape(loss.shape))
    if loss_rows is not None:
        loss_rows.copy_(row_sums.float())
    if loss_elems is not None:
        loss_elems.copy_(el)
    if dx is not None:
        f = 0.0 if den == 0 else grad_scale / den
        w = None
        if grad_output is not None:
            go = grad_output.float()
            if reduction != 0:
                f = f * float(go.reshape(-1)[0])
            elif kind == 0:
                g = g * go.reshape(-1, 1)
            else:
                w = go
        if w is not None:
            g = g * w
        g = g * f
        if student_input == 2:  # through the log-softmax to the logits
            g = (g - xp * g.double().sum(-1, keepdim=True).float()) / temperature
        dx.copy_(g.to(dx.dtype))


def adamw_plan(params, grads, exp_avgs, exp_avg_sqs, masters):
    """tigon.adamw_plan: the plan's bytes (its contents only the CUDA step reads)."""
    from tigon_torch.optim import plan_bytes

    _adamw_lists("tigon.adamw_plan", params, grads, exp_avgs, exp_avg_sqs, masters)
    return torch.zeros(plan_bytes([p.numel() for p in params]), dtype=torch.uint8, device=params[0].device)


def _adamw_lists(op, params, grads, exp_avgs, exp_avg_sqs, masters):
    n = len(params)
    if n == 0:
        raise ValueError(f"{op}: the parameter list is empty")
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n) or len(masters) not in (0, n):
        raise ValueError(f"{op}: the lists must have one entry each per parameter")
    pt, st = params[0].dtype, exp_avgs[0].dtype
    if st not in (pt, torch.float32):
        raise TypeError(f"{op}: the moments' dtype ({st}) must be float32 or the parameters' ({pt})")
    for i, p in enumerate(params):
        for name, t, dt in (("params", p, pt), ("grads", grads[i], pt), ("exp_avgs", exp_avgs[i], st),
                            ("exp_avg_sqs", exp_avg_sqs[i], st)) + ((("masters", masters[i], torch.float32),)
                                                                     if masters else ()):
            if t.dtype != dt:
                raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}, expected {dt}")
            if t.numel() != p.numel():
                raise ValueError(f"{op}: {name}[{i}] has {t.numel()} elements, its parameter {p.numel()}")


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, plan, lr, lr_value, step, beta1, beta2, eps,
               weight_decay,
               decoupled, grad_scale, clip_factor, found_inf, stochastic_rounding, seed):
    """tigon.adamw_step: AdamWRule per element (tigon/optim/adamw.cuh) in torch ops: every operation in
    fp32, each fused multiply-add as one rounding (its exact fp64 product and sum, rounded to fp32)."""
    _adamw_lists("tigon.adamw_step", params, grads, exp_avgs, exp_avg_sqs, masters)
    if stochastic_rounding:
        raise NotImplementedError("tigon.adamw_step: the CPU reference has no stochastic rounding")
    if found_inf is not None and float(found_inf) != 0.0:
        return
    step.add_(1)
    f32 = lambda x: torch.as_tensor(x, dtype=torch.float64).float()  # noqa: E731
    fma = lambda a, b, c: (a.double() * b.double() + c.double()).float()  # noqa: E731
    t = f32(float(step))
    lr32 = f32(float(lr) if lr is not None else float(lr_value))
    b1, b2, eps32, wd = f32(beta1), f32(beta2), f32(eps), f32(weight_decay)
    step_size = lr32 / (1.0 - f32(torch.pow(b1.double(), t.double())))
    bc2_sqrt = torch.sqrt(1.0 - f32(torch.pow(b2.double(), t.double())))
    for i, p in enumerate(params):
        w = masters[i].clone() if masters else p.float()
        g = grads[i].float()
        if grad_scale is not None and float(grad_scale) != 1.0:
            g = g / grad_scale.float().reshape(())
        if clip_factor is not None and float(clip_factor) != 1.0:
            g = g * clip_factor.float().reshape(())
        if float(wd) != 0.0:
            if decoupled:
                w = fma(-(lr32 * wd), w, w)
            else:
                g = fma(w, wd, g)
        m = fma(b1, exp_avgs[i].float(), fma(-b1, g, g))
        gg = g * g
        v = fma(b2, exp_avg_sqs[i].float(), fma(-b2, gg, gg))
        denom = torch.sqrt(v) / bc2_sqrt + eps32
        w = w - step_size * m / denom
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)
        if masters:
            masters[i].copy_(w)
        p.copy_(w)


def adamw_grad_norm(params, grads, exp_avgs, exp_avg_sqs, masters, plan, max_norm, norm, factor, grad_scale):
    """tigon.adamw_grad_norm: the gradients' global L2 norm (squares in fp32 per tensor, summed in fp64),
    unscaled by grad_scale, and torch's clip factor min(1, max_norm / (norm + 1e-6))."""
    _adamw_lists("tigon.adamw_grad_norm", params, grads, exp_avgs, exp_avg_sqs, masters)
    sq = sum(g.float().square().sum().double() for g in grads)
    if grad_scale is not None:
        sq = sq / grad_scale.double().reshape(()) ** 2
    nv = torch.sqrt(sq).float()
    f = (max_norm / (nv + 1e-6)).float()
    if norm is not None:
        norm.copy_(nv)
    if factor is not None:
        factor.copy_(torch.where(f < 1.0, f, torch.where(f >= 1.0, torch.ones_like(f), f)))


OPS = [rms_norm_fwd, rms_norm_bwd, layer_norm_fwd, layer_norm_bwd, add_rms_norm_fwd, add_rms_norm_bwd, rope,
       gated_fwd, gated_bwd, relu2_fwd, relu2_bwd, cross_entropy, linear_cross_entropy, linear_cross_entropy_heads, linear_logprob, linear_logprob_bwd, scale_rows,
       target_range,
       divergence, adamw_plan, adamw_step, adamw_grad_norm]


def install() -> None:
    """Registers the references as the CPU kernels of torch.ops.tigon.* (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    from tigon_torch import ops

    ops.ops()  # the schemas
    _LIB = torch.library.Library("tigon", "IMPL")
    checks = ops._fake_checks()
    for fn in OPS:
        _LIB.impl(fn.__name__, _checked(fn, checks.get(fn.__name__)), "CPU")


def _checked(fn, check):
    """fn after the shape and dtype checks the CUDA operator makes first (ops._fake_checks), so that a
    call the GPU refuses fails here too."""
    if check is None:
        return fn

    def run(*args):
        check(*args)
        return fn(*args)

    run.__name__ = fn.__name__
    return run
