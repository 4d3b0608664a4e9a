// Session s22: tile loads, vector loads and a 2 x 2 load-and-multiply loop over working sets of 16 KiB - 256 MiB,
// one thread (what each level of the memory hierarchy gives a TILELOADD). Numbers: RESULTS.md "Session s22".
//   gcc -O2 -march=native tile_load_probe.c -o /tmp/tl && flock /work/bench.lock /tmp/tl
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  TileConfig c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  _tile_loadconfig(&c);
  size_t maxs = 256u << 20;
  char* buf = aligned_alloc(4096, maxs); memset(buf, 1, maxs);
  for (size_t s = 16 << 10; s <= maxs; s *= 4) {
    size_t reps = (1u << 30) / s; if (reps < 2) reps = 2;
    double t = now();
    for (size_t r = 0; r < reps; ++r)
      for (size_t o = 0; o < s; o += 4096) {
        _tile_loadd(0, buf + o, 64); _tile_loadd(1, buf + o + 1024, 64); _tile_loadd(2, buf + o + 2048, 64); _tile_loadd(3, buf + o + 3072, 64);
      }
    t = now() - t;
    double t2 = now(); __m512 acc = _mm512_setzero_ps();
    for (size_t r = 0; r < reps; ++r)
      for (size_t o = 0; o < s; o += 256) {
        acc = _mm512_add_ps(acc, _mm512_load_ps(buf + o)); acc = _mm512_add_ps(acc, _mm512_load_ps(buf + o + 64));
        acc = _mm512_add_ps(acc, _mm512_load_ps(buf + o + 128)); acc = _mm512_add_ps(acc, _mm512_load_ps(buf + o + 192));
      }
    t2 = now() - t2;
    float f[16]; _mm512_storeu_ps(f, acc);
    // tile loads + dp (4 loads, 4 dp per 4 KiB) in-place
    double t3 = now();
    for (size_t r = 0; r < reps; ++r)
      for (size_t o = 0; o < s; o += 4096) {
        _tile_loadd(4, buf + o, 64); _tile_loadd(6, buf + o + 1024, 64); _tile_loadd(5, buf + o + 2048, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_loadd(7, buf + o + 3072, 64); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 5, 7);
      }
    t3 = now() - t3;
    printf("%8zu KB: tile loads %.1f GB/s, vector loads %.1f GB/s, 2x2 loads+dp %.1f GB/s (%.2f ns/dp) %g\n", s >> 10,
           s * reps / t / 1e9, s * reps / t2 / 1e9, s * reps / t3 / 1e9, t3 * 1e9 / (reps * s / 1024), f[0]);
  }
}
