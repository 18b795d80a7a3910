/* kernels.c's three functions called on numbers read from stdin, for tests/test_kernels_qemu.py:
   it builds kernels.c's NEON path with this file and runs them under qemu-user on a machine that
   is not ARM, where ctypes cannot load an aarch64 library.

   stdin: calls, one after another, to its end. A call is the function's name (linear_bf16,
   attend_bf16 or block_bf16), then its arguments in its own order, each a byte count (int64)
   followed by that many bytes: an integer as int64, a float as float32, an array as it lies in
   memory, nothing for NULL. block_bf16's Layer comes field by field, arrays in place of the
   addresses, in its declared order (kernels.NativeLayer's).
   stdout: each call's outputs in turn: linear_bf16's y; attend_bf16's y; block_bf16's out, then
   its k and v caches, as the call left them. An error: a line on stderr, exit status 1. */
#include <stdio.h>

#include "../kernels.c"   /* its functions, its Layer: compiled here, with the path's flags */

static void fail(const char *why) {
  fprintf(stderr, "kernels_harness: %s\n", why);
  exit(1);
}

/* The next argument's bytes (NULL for none), their count in *bytes where asked. Never freed: the
   process lives for one test. */
static void *array(long *bytes) {
  int64_t n;
  if (fread(&n, sizeof n, 1, stdin) != 1) fail("stdin ends inside a call");
  if (bytes) *bytes = n;
  if (n == 0) return NULL;
  void *p = malloc(n);
  if (!p || fread(p, 1, n, stdin) != (size_t)n) fail("stdin ends inside an argument");
  return p;
}
static long integer(void) { return *(const int64_t *)array(NULL); }
static float real(void) { return *(const float *)array(NULL); }
static void put(const void *p, long bytes) {
  if (fwrite(p, 1, bytes, stdout) != (size_t)bytes) fail("stdout not written");
}

static void linear(void) {
  const bf16 *x = array(NULL);
  int M = integer();
  int K = integer();
  const void *w = array(NULL);
  const float *scale = array(NULL);
  int N = integer();
  const bf16 *bias = array(NULL);
  const bf16 *add = array(NULL);
  bf16 *y = malloc(sizeof(bf16) * M * N);
  if (linear_bf16(x, M, K, w, scale, N, bias, add, y)) fail("linear_bf16 failed");
  put(y, sizeof(bf16) * M * N);
}

static void attend(void) {
  const bf16 *q = array(NULL);
  int B = integer();
  int H = integer();
  int T = integer();
  int Dh = integer();
  const bf16 *k = array(NULL);
  const bf16 *v = array(NULL);
  int Hkv = integer();
  int S = integer();
  long row = integer();
  long head = integer();
  const uint8_t *mask = array(NULL);
  float scale = real();
  bf16 *y = malloc(sizeof(bf16) * B * T * H * Dh);
  if (attend_bf16(q, B, H, T, Dh, k, v, Hkv, S, row, head, mask, scale, y)) fail("attend_bf16 failed");
  put(y, sizeof(bf16) * B * T * H * Dh);
}

static void block(void) {
  Layer L;
  L.D = integer(), L.H = integer(), L.Hkv = integer(), L.Dh = integer(), L.F = integer();
  L.gelu = integer();
  L.eps = real();
  L.norm1 = array(NULL), L.norm2 = array(NULL), L.bqkv = array(NULL);
  L.qnorm = array(NULL), L.knorm = array(NULL);
  L.wqkv = array(NULL), L.wo = array(NULL), L.wgu = array(NULL), L.wdown = array(NULL);
  L.sqkv = array(NULL), L.so = array(NULL), L.sgu = array(NULL), L.sdown = array(NULL);
  const bf16 *x = array(NULL);
  int B = integer();
  int T = integer();
  const bf16 *cos = array(NULL);
  const bf16 *sin = array(NULL);
  long cache_bytes;
  bf16 *k_cache = array(&cache_bytes);
  bf16 *v_cache = array(NULL);
  long row = integer();
  long head = integer();
  int start = integer();
  const uint8_t *mask = array(NULL);
  bf16 *out = malloc(sizeof(bf16) * B * T * L.D);
  if (block_bf16(&L, x, B, T, cos, sin, k_cache, v_cache, row, head, start, mask, out))
    fail("block_bf16 failed");
  put(out, sizeof(bf16) * B * T * L.D);
  put(k_cache, cache_bytes);
  put(v_cache, cache_bytes);
}

int main(void) {
  int64_t n;
  while (fread(&n, sizeof n, 1, stdin) == 1) {   /* a call's name: its length, then itself */
    char name[16] = {0};
    if (n <= 0 || n >= (int64_t)sizeof name || fread(name, 1, n, stdin) != (size_t)n)
      fail("a call's name expected");
    if (!strcmp(name, "linear_bf16")) linear();
    else if (!strcmp(name, "attend_bf16")) attend();
    else if (!strcmp(name, "block_bf16")) block();
    else fail("no such function");
  }
  return 0;
}
