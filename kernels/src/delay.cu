// A kernel that only waits: the pool enqueues it on the transfer stream when a
// test asks for deliberately slow transfers, to prove compute really waits on
// each block's ready event rather than on luck.
#include <stdint.h>

extern "C" __global__ void spin_ns(uint64_t ns) {
  uint64_t start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
    __nanosleep(1000);
  }
}
