// The compiled hidden sizes of tigon's norm launchers (TIGON_HIDDEN_SIZES) for this extension.
// The build writes tigon_torch_hidden_sizes.h into a directory of its own, and puts that directory
// on the include path, only when TIGON_TORCH_HIDDEN_SIZES is set in its environment; otherwise
// tigon's default list applies. Included before any tigon header.
#pragma once

#if __has_include(<tigon_torch_hidden_sizes.h>)
#include <tigon_torch_hidden_sizes.h>
#endif
