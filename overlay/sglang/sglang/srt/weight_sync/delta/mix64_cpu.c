/* The mix64 hashes on CPU: the flush checksum's blob sums and the fingerprint's row sums of mix64.py, as plain loops
 * that the compiler vectorizes. Below AVX-512 no vector unit multiplies 64-bit lanes, and torch's vector classes
 * then multiply one lane at a time; a compiler builds each 64-bit product from three 32-bit ones (vpmuludq), which
 * is what makes these loops 2-4x the compiled torch kernels on AVX2. One clone per vector ISA, picked when the
 * library loads (x86-64). Valid C and C++; every function is called from Python (ctypes) on one thread's share. */
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CLONES
#endif

#ifdef __cplusplus
#define API extern "C"
#else
#define API
#endif

#define C1 0x9E3779B97F4A7C15ULL
#define C2 0xBF58476D1CE4E5B9ULL
#define C3 0x94D049BB133111EBULL

static inline uint64_t mix(uint64_t z) { /* splitmix64's finalizer */
  z ^= z >> 30;
  z *= C2;
  z ^= z >> 27;
  z *= C3;
  return z ^ (z >> 31);
}

/* out[0] = sum of mix(w[i] ^ (i * C1 + key0)); out[1] = OR over words of ((w & mask) + add) & top (non-zero: a NaN
 * lane). A constant `nan` lets the compiler drop the NaN test where the blob has no float lanes. */
static inline void sum_body(const uint64_t *w, int64_t n, uint64_t key0, uint64_t mask, uint64_t add, uint64_t top,
                            uint64_t *out, const int nan) {
  uint64_t s = 0, f = 0;
  for (int64_t i = 0; i < n; i++) {
    uint64_t x = w[i];
    if (nan) f |= ((x & mask) + add) & top;
    s += mix(x ^ ((uint64_t)i * C1 + key0));
  }
  out[0] = s;
  out[1] = f;
}

API CLONES void mix64_sum(const uint64_t *w, int64_t n, uint64_t key0, uint64_t mask, uint64_t add, uint64_t top,
                          uint64_t *out) {
  if (top)
    sum_body(w, n, key0, mask, add, top, out, 1);
  else
    sum_body(w, n, key0, 0, 0, 0, out, 0);
}

/* out[r] = sum over c of mix((rk[r] + c * g0) ^ ((bits[r][c] widened & mask) * C2)), rows contiguous: an element
 * widens to 64 bits as torch's .to(int64) does (uint8 zero-extended, signed widths sign-extended). */
#define ROWS(NAME, T)                                                                                               \
  API CLONES void NAME(const T *bits, int64_t rows, int64_t cols, const uint64_t *rk, uint64_t g0, uint64_t mask,  \
                       uint64_t *out) {                                                                             \
    for (int64_t r = 0; r < rows; r++) {                                                                            \
      const T *b = bits + r * cols;                                                                                 \
      uint64_t key = rk[r], s = 0;                                                                                  \
      for (int64_t c = 0; c < cols; c++, key += g0) /* the key by addition: a multiply less per element */          \
        s += mix(key ^ (((uint64_t)(int64_t)b[c] & mask) * C2));                                                    \
      out[r] = s;                                                                                                   \
    }                                                                                                               \
  }

ROWS(mix64_rows_uint8, uint8_t)
ROWS(mix64_rows_int16, int16_t)
ROWS(mix64_rows_int32, int32_t)
ROWS(mix64_rows_int64, int64_t)
