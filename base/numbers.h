// Numbers as people read them.
#pragma once

#include <cmath>

namespace remora::base {

// `v`, or a NaN without its sign bit. A NaN that arithmetic makes (0/0,
// inf - inf: a run that diverged) has the sign bit set on x86, and printf
// writes it `-nan`; a loss's NaN has no sign worth showing.
inline double UnsignedNan(double v) { return std::isnan(v) ? std::fabs(v) : v; }

}  // namespace remora::base
