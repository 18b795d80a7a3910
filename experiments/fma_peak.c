/* The CPU's peak for kernels.c's AVX2 products: fused multiply-adds on 8 floats, 10 independent
   chains per thread (more than the FMA units' latency times their number), nothing else.

     cc -O3 -mavx2 -mfma -fopenmp experiments/fma_peak.c -o /tmp/fma_peak
     OMP_NUM_THREADS=1 /tmp/fma_peak; OMP_NUM_THREADS=2 /tmp/fma_peak

   Prints GFLOP/s (a multiply-add is 2): what results/batch-cpu.md sets kernels.c's products
   beside. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

int main(void) {
  const long iters = 200000000;
  float kept = 0;
  double seconds = omp_get_wtime();
#pragma omp parallel reduction(+ : kept)
  {
    __m256 acc[10], b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
    for (int i = 0; i < 10; i++) acc[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iters; it++) {
#pragma GCC unroll 10
      for (int i = 0; i < 10; i++) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
    }
    float out[8];
    _mm256_storeu_ps(out, acc[9]);
    kept += out[0];   /* used, so that nothing is optimised away */
  }
  seconds = omp_get_wtime() - seconds;
  int threads = omp_get_max_threads();
  printf("%d threads: %.1f GFLOP/s (%.2f s; %g)\n", threads, threads * iters * 10 * 16.0 / seconds / 1e9,
         seconds, kept);
  return 0;
}
