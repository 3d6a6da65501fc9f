// minispeed/threads.h: the OpenMP thread count every CPU op reports to Python as `max_threads`.
//
// Shared like simd.h (core's csrc/include is on every op's include path and in its cache key).
// An op built without OpenMP runs its loops on one thread, and says so.

#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif

namespace minispeed {

// OpenMP threads a parallel loop may use now: torch.set_num_threads applies, since the op resolves
// to the libgomp torch already loaded (same soname). 1 in a build without OpenMP.
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace minispeed
