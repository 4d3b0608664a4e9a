#include <time.h>
void spin_ns(long ns) { struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
  volatile double x = 1.0;
  for (;;) { for (int i = 0; i < 1000; ++i) x = x * 1.0000001 + 1e-9; clock_gettime(CLOCK_MONOTONIC, &b);
    if ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) >= ns) break; } }
