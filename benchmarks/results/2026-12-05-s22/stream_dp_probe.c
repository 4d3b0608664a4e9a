// Session s22: does AMX work overlap with streaming its weights from DRAM? One pass over 256 MB, a 1 KiB tile
// loaded per step and multiplied by 0, 2 or 4 activation tiles (a 64-row decode step does 4 per weight tile),
// the activations from L1 (4-16 KiB) or L2 (64-256 KiB); 1 and 2 threads. Numbers: RESULTS.md "Session s22".
//   gcc -O2 -march=native -fopenmp stream_dp_probe.c -o /tmp/st && flock /work/bench.lock /tmp/st
// Stream W (256 MB) once, 4 dp per 1 KiB W tile (1x4: W x 4 activation tiles), x tiles from L1 (8 KiB) or L2 (xs KiB).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;
static void configure(void) { TileConfig c; memset(&c, 0, sizeof c); c.palette = 1; for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; } asm volatile("" : : "r"(&c) : "memory"); _tile_loadconfig(&c); }
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const size_t S = 256u << 20;
  char* w = aligned_alloc(4096, S); memset(w, 1, S);
  char* x = aligned_alloc(4096, 256 << 10); memset(x, 1, 256 << 10);
  for (int round = 0; round < 2; ++round)
  for (int threads = 1; threads <= 2; ++threads)
  for (int xkb = 4; xkb <= 256; xkb *= 4)
  for (int dps = 0; dps <= 4; dps += 2) {
    double t = now();
#pragma omp parallel num_threads(threads)
    {
      configure();
      const int id = omp_get_thread_num();
      const size_t lo = S / threads * id, hi = S / threads * (id + 1);
      const size_t xmask = (size_t)xkb * 1024 - 1;
      size_t xo = 0;
      for (size_t o = lo; o < hi; o += 1024) {
        _tile_loadd(4, w + o, 64);
        if (dps >= 1) { _tile_loadd(5, x + (xo & xmask), 64); _tile_dpbf16ps(0, 5, 4); }
        if (dps >= 2) { _tile_loadd(6, x + ((xo + 1024) & xmask), 64); _tile_dpbf16ps(1, 6, 4); }
        if (dps >= 3) { _tile_loadd(7, x + ((xo + 2048) & xmask), 64); _tile_dpbf16ps(2, 7, 4); }
        if (dps >= 4) { _tile_loadd(5, x + ((xo + 3072) & xmask), 64); _tile_dpbf16ps(3, 5, 4); }
        xo += 4096;
      }
      _tile_release();
    }
    t = now() - t;
    printf("threads %d x %3d KiB dp/KiB %d: %.1f GB/s\n", threads, xkb, dps, S / t / 1e9);
  }
}
