// tigon/tigon.cuh - every op of tigon. Include this, or only the op headers you use.
#pragma once

#include "core/config.hpp"
#include "core/dispatch.hpp"
#include "core/dtype.hpp"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/validate.hpp"
#include "activation/activations.hpp"
#include "activation/gated.cuh"
#include "norm/rms_norm.cuh"
#include "norm/layer_norm.cuh"
#include "norm/add_rms_norm.cuh"
#include "rope/rope.cuh"
#include "loss/cross_entropy.cuh"
#include "loss/divergence.cuh"
#include "loss/linear_cross_entropy.cuh"
#include "loss/linear_divergence.cuh"
#include "loss/linear_logprob.cuh"
#include "optim/adamw.cuh"

#if defined(__CUDACC__)
#include "core/colsum.cuh"
#include "core/device.hpp"
#include "core/reduce.cuh"
#include "core/vector.cuh"
#endif
