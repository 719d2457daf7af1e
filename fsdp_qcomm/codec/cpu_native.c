/* Fused CPU loops for the wire format of fsdp_qcomm/codec/wire.py.
 *
 * The same bytes as torch_codec.py and the Triton kernels, one pass per row window instead of
 * one torch op per pass: source (x, x - ref, or the in-order sum of decoded wire rows), the
 * 32-point Hadamard butterflies, per-group min/max, scale, counter-hash uniforms, floor, clamp
 * and bit packing all happen on a cache-resident window. Every float operation is the one the
 * torch code performs, in the same order, and the file is built with -ffp-contract=off (no
 * fused multiply-adds), so results are bit-identical; tests/test_codec_native.py checks it.
 *
 * Learned-levels rows (fsdp_qcomm/codec/levels.py: the 2^b fp32 levels in front of the same
 * sections, codes that index the table) use the same windows and source (fq_encode_levels,
 * fq_decode_levels_sum).
 *
 * Only fp32 scales are handled here; fsdp_qcomm/codec/cpu_native.py falls back to the torch
 * code for other scale dtypes. Built and loaded by cpu_native.py (plain C, no Python API).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIX_M1 0x7FEB352Du
#define MIX_M2 0x846CA68Bu
#define NAN_BITS_F32 0x7FC00000u
#define WINDOW 8192 /* elements per window (rounded to whole groups and 32-blocks) */

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= MIX_M1;
    x ^= x >> 15;
    x *= MIX_M2;
    x ^= x >> 16;
    return x;
}

/* The uniform of the even (odd = 0) or odd (odd = 1) element of a pair whose hash is h:
 * (16 bits + 1/2) * 2^-16, built from its float bits as codec/rng.py does (exact). */
static inline float pair_uniform(uint32_t h, int odd) {
    uint32_t b = ((odd ? h >> 9 : h << 7) & 0x7FFF80u) | 0x3F800040u;
    float f;
    memcpy(&f, &b, 4);
    return f - 1.0f;
}

/* The hash of the pair whose even element has counter c (codec/rng.py). */
static inline uint32_t pair_hash(uint32_t c, uint32_t k0, uint32_t k1) {
    return mix32(mix32(c ^ k0) ^ k1);
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static int64_t lcm64(int64_t a, int64_t b) { return a / gcd64(a, b) * b; }

/* Window length: a multiple of both group sizes and of 32 (Hadamard blocks), near WINDOW, so
 * every window starts on a group of the input and of the output and on a 32-block. */
static int64_t window_len(int64_t gs, int64_t gs_in) {
    int64_t unit = lcm64(lcm64(gs, 32), gs_in);
    int64_t w = (WINDOW / unit) * unit;
    return w > 0 ? w : unit;
}

typedef struct {
    int bits;
    int64_t gs;
    int symmetric;
    int learned; /* rows start with a table of 2^bits fp32 levels (codec/levels.py) */
} spec_t;

/* Bytes in front of a row's scale section: the level table of learned-levels rows. */
static inline int64_t table_bytes(const spec_t *s) { return s->learned ? (int64_t)4 << s->bits : 0; }

static inline int64_t num_groups(int64_t n, int64_t gs) { return (n + gs - 1) / gs; }

static inline int64_t code_offset(int64_t n, const spec_t *s) {
    return num_groups(n, s->gs) * 4 * (s->symmetric ? 1 : 2);
}

static inline int qmax_of(const spec_t *s) {
    return s->symmetric ? (1 << (s->bits - 1)) - 1 : (1 << s->bits) - 1;
}

static inline float load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

static inline void store_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* 32-point butterflies (h = 1..16: (b[j], b[j + h]) -> (a + c, a - c), as
 * torch_codec._butterfly) on eight-lane vectors: stages 1, 2, 4 pair lanes of one vector, a lane
 * shuffle brings each partner p across, and p + a * s (s = +1 / -1 per lane) is exactly a + p
 * for the lower lane of a pair and p - a for the upper one (x * -1 is exact, x + -y == x - y
 * and addition commutes in IEEE arithmetic); stages 8 and 16 pair whole vectors. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE(v, ...) __builtin_shuffle(v, (v8i){__VA_ARGS__})
#endif

static inline void hadamard32_block(float *b) {
    const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1};
    const v8f s2 = {1, 1, -1, -1, 1, 1, -1, -1};
    const v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
    v8f v[4];
    memcpy(v, b, sizeof v);
    for (int k = 0; k < 4; k++) {
        v8f a = v[k];
        a = SHUFFLE(a, 1, 0, 3, 2, 5, 4, 7, 6) + a * s1;
        a = SHUFFLE(a, 2, 3, 0, 1, 6, 7, 4, 5) + a * s2;
        v[k] = SHUFFLE(a, 4, 5, 6, 7, 0, 1, 2, 3) + a * s4;
    }
    v8f t0 = v[0] + v[1], t1 = v[0] - v[1], t2 = v[2] + v[3], t3 = v[2] - v[3];
    v[0] = t0 + t2;
    v[2] = t0 - t2;
    v[1] = t1 + t3;
    v[3] = t1 - t3;
    memcpy(b, v, sizeof v);
}

/* Unnormalized Sylvester Hadamard on each 32-block of v[0, len), len a multiple of 32:
 * stages h = 1..16, as torch_codec._butterfly. */
static void hadamard32(float *v, int64_t len) {
    for (int64_t o = 0; o < len; o += 32) hadamard32_block(v + o);
}

/* ---- bit packing --------------------------------------------------------------------------- */
/* codes[0, cnt) (cnt a multiple of 8, each < 2^bits) -> cnt * bits / 8 bytes, LSB first. */
static void pack(const uint8_t *codes, int64_t cnt, int bits, uint8_t *dst) {
    if (bits == 8) {
        memcpy(dst, codes, (size_t)cnt);
    } else if (bits == 4) {
        for (int64_t j = 0; j < cnt / 2; j++)
            dst[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    } else if (bits == 2) {
        for (int64_t j = 0; j < cnt / 4; j++)
            dst[j] = (uint8_t)(codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) |
                               (codes[4 * j + 3] << 6));
    } else {
        for (int64_t e = 0; e < cnt; e += 8) {
            uint64_t w = 0;
            for (int k = 0; k < 8; k++) w |= (uint64_t)codes[e + k] << (bits * k);
            for (int k = 0; k < bits; k++) dst[(e / 8) * bits + k] = (uint8_t)(w >> (8 * k));
        }
    }
}

/* Inverse of pack: cnt (a multiple of 8) codes from cnt * bits / 8 bytes. */
static void unpack(const uint8_t *src, int64_t cnt, int bits, uint8_t *codes) {
    if (bits == 8) {
        memcpy(codes, src, (size_t)cnt);
    } else if (bits == 4) {
        for (int64_t j = 0; j < cnt / 2; j++) {
            codes[2 * j] = src[j] & 15;
            codes[2 * j + 1] = src[j] >> 4;
        }
    } else if (bits == 2) {
        for (int64_t j = 0; j < cnt / 4; j++) {
            uint8_t b = src[j];
            codes[4 * j] = b & 3;
            codes[4 * j + 1] = (b >> 2) & 3;
            codes[4 * j + 2] = (b >> 4) & 3;
            codes[4 * j + 3] = b >> 6;
        }
    } else {
        uint64_t mask = (1u << bits) - 1;
        for (int64_t e = 0; e < cnt; e += 8) {
            uint64_t w = 0;
            for (int k = 0; k < bits; k++) w |= (uint64_t)src[(e / 8) * bits + k] << (8 * k);
            for (int k = 0; k < 8; k++) codes[e + k] = (uint8_t)((w >> (bits * k)) & mask);
        }
    }
}

/* ---- decode ---------------------------------------------------------------------------------- */
/* dst[i] (=, or += when add) decoded element w0 + i of one wire row, for i in [0, w1 - w0).
 * w0 is a multiple of the group size; decoded value = (code - bias) * scale (+ min), or for
 * learned levels L[code] * scale (+ min) with L the row's own table. */
static void decode_window(const uint8_t *row, int64_t n, const spec_t *s, int64_t w0, int64_t w1,
                          float *dst, int add, uint8_t *codes) {
    int64_t cnt = ((w1 - w0) + 7) / 8 * 8;
    int64_t G = num_groups(n, s->gs);
    const uint8_t *base = row + table_bytes(s); /* the scale section */
    const uint8_t *cb = base + code_offset(n, s) + w0 / 8 * s->bits;
    unpack(cb, cnt, s->bits, codes);
    float lv[256];
    if (s->learned) memcpy(lv, row, (size_t)table_bytes(s));
    float bias = s->symmetric ? (float)qmax_of(s) : 0.0f;
    for (int64_t g0 = w0; g0 < w1; g0 += s->gs) {
        int64_t g = g0 / s->gs, e = g0 + s->gs < w1 ? g0 + s->gs : w1;
        float scale = load_f32(base + 4 * g);
        float mn = s->symmetric ? 0.0f : load_f32(base + 4 * (G + g));
        const uint8_t *c = codes + (g0 - w0);
        float *d = dst + (g0 - w0);
        int64_t len = e - g0;
        if (s->learned) {
            for (int64_t i = 0; i < len; i++) {
                float x = lv[c[i]] * scale;
                if (!s->symmetric) x = x + mn;
                d[i] = add ? d[i] + x : x;
            }
        } else if (s->symmetric) {
            if (add)
                for (int64_t i = 0; i < len; i++) {
                    float x = ((float)c[i] - bias) * scale;
                    d[i] = d[i] + x;
                }
            else
                for (int64_t i = 0; i < len; i++) d[i] = ((float)c[i] - bias) * scale;
        } else {
            if (add)
                for (int64_t i = 0; i < len; i++) {
                    float x = (float)c[i] * scale;
                    x = x + mn;
                    d[i] = d[i] + x;
                }
            else
                for (int64_t i = 0; i < len; i++) {
                    float x = (float)c[i] * scale;
                    d[i] = x + mn;
                }
        }
    }
}

/* ---- encode ---------------------------------------------------------------------------------- */
/* Min / max of v[0, len) and whether any value is NaN or infinite (then min/max are unused).
 * The non-finite test is integer arithmetic. Eight-lane vectors keep eight independent running
 * min / max (lane l sees elements l, l + 8, ...), each updated with `a < m ? a : m` written as
 * a compare and a bit select, which is exact IEEE arithmetic the compiler may not reorder and
 * needs no fast-math flag (it becomes vector compare/blend or min/max instructions). Min and max
 * of finite values do not depend on that order, except for which zero comes out of {-0, +0},
 * and no result depends on a zero's sign (a zero scale becomes 1, a zero minimum or range is
 * stored as +0). */
static int group_minmax(const float *v, int64_t len, float *pmn, float *pmx) {
    const v8i expo = {0x7F800000, 0x7F800000, 0x7F800000, 0x7F800000,
                      0x7F800000, 0x7F800000, 0x7F800000, 0x7F800000};
    float mn = v[0], mx = v[0];
    uint32_t nf = 0;
    int64_t i = 0;
    if (len >= 8) {
        v8f vmn, vmx;
        memcpy(&vmn, v, sizeof vmn);
        vmx = vmn;
        v8i bad = {0, 0, 0, 0, 0, 0, 0, 0};
        for (; i + 8 <= len; i += 8) {
            v8f a;
            memcpy(&a, v + i, sizeof a);
            v8i ai = (v8i)a;
            bad |= (ai & expo) == expo;
            v8i lt = a < vmn, gt = a > vmx;
            vmn = (v8f)((ai & lt) | ((v8i)vmn & ~lt));
            vmx = (v8f)((ai & gt) | ((v8i)vmx & ~gt));
        }
        for (int l = 0; l < 8; l++) {
            nf |= (uint32_t)bad[l];
            mn = vmn[l] < mn ? vmn[l] : mn;
            mx = vmx[l] > mx ? vmx[l] : mx;
        }
    }
    for (; i < len; i++) {
        float a = v[i];
        uint32_t b;
        memcpy(&b, &a, 4);
        nf |= (b & 0x7F800000u) == 0x7F800000u;
        mn = a < mn ? a : mn;
        mx = a > mx ? a : mx;
    }
    *pmn = mn;
    *pmx = mx;
    return nf != 0;
}

/* group_minmax for group g of a row, which also handles a non-finite group: its scale (and
 * min) get the NaN bits, its len codes the zero code; returns 1 then (the caller skips it). */
static int group_bounds(const float *x, int64_t len, const spec_t *s, uint8_t *row, int64_t G,
                        int64_t g, uint8_t *c, int zero_code, float *mn, float *mx) {
    if (!group_minmax(x, len, mn, mx)) return 0;
    store_u32(row + 4 * g, NAN_BITS_F32);
    if (!s->symmetric) store_u32(row + 4 * (G + g), NAN_BITS_F32);
    memset(c, zero_code, (size_t)len);
    return 1;
}

/* 1 / (scale * *f), with *f = 2^64 below a scale of 2^-64 (wire.TINY_SCALE), else 1: an encoder
 * divides by its nonzero scale as t = (x * f) * r (wire.py, "Encoding"). */
static inline float group_reciprocal(float scale, float *f) {
    *f = scale < 0x1p-64f ? 0x1p64f : 1.0f;
    return 1.0f / (scale * *f);
}

/* Quantize the groups of window [w0, w1) of one row (values v[0, w1 - w0), overwritten) into
 * codes and the row's scale / min section. ctr0: the RNG counter of element w0 (row * n + w0, mod 2^32). */
static void encode_window(float *v, int64_t n, const spec_t *s, int64_t w0, int64_t w1,
                          int stochastic, uint32_t k0, uint32_t k1, uint32_t ctr0, uint8_t *row,
                          uint8_t *codes) {
    int64_t G = num_groups(n, s->gs);
    int qmax = qmax_of(s);
    float fq = (float)qmax;
    int32_t ilo = s->symmetric ? -qmax : 0;
    int bias = s->symmetric ? qmax : 0;
    for (int64_t g0 = w0; g0 < w1; g0 += s->gs) {
        int64_t g = g0 / s->gs, len = (g0 + s->gs < w1 ? g0 + s->gs : w1) - g0;
        float *x = v + (g0 - w0);
        uint8_t *c = codes + (g0 - w0);
        float mn, mx, scale, mins = 0.0f;
        if (group_bounds(x, len, s, row, G, g, c, bias, &mn, &mx)) continue;
        if (s->symmetric) {
            float amax = mx > -mn ? mx : -mn;
            scale = amax / fq;
        } else {
            mins = mn + 0.0f; /* a -0 minimum is stored as +0 */
            scale = (mx - mins) / fq;
        }
        if (scale == 0.0f) scale = 1.0f;
        memcpy(row + 4 * g, &scale, 4);
        if (!s->symmetric) memcpy(row + 4 * (G + g), &mins, 4);
        /* t = (x * f) * (1 / (scale * f)) (x - min for x if asymmetric; f = 2^64 below a
         * scale of 2^-64, else 1: wire.TINY_SCALE), then + u or + 1/2, floor, clamp, code. */
        float *t = x;
        float f;
        float r = group_reciprocal(scale, &f);
        if (s->symmetric)
            for (int64_t i = 0; i < len; i++) t[i] = (x[i] * f) * r;
        else
            for (int64_t i = 0; i < len; i++) t[i] = ((x[i] - mins) * f) * r;
        if (stochastic) {
            /* g0 - w0 is a multiple of the group size, so i's parity is its row index's */
            uint32_t ctr = ctr0 + (uint32_t)(g0 - w0);
            for (int64_t i = 0; i + 1 < len; i += 2) {
                uint32_t h = pair_hash(ctr + (uint32_t)i, k0, k1);
                t[i] = t[i] + pair_uniform(h, 0);
                t[i + 1] = t[i + 1] + pair_uniform(h, 1);
            }
            if (len & 1) /* a last group of odd length: its last element has no partner */
                t[len - 1] = t[len - 1] + pair_uniform(pair_hash(ctr + (uint32_t)(len - 1), k0, k1), 0);
        } else {
            for (int64_t i = 0; i < len; i++) t[i] = t[i] + 0.5f;
        }
        /* floor(t) is a finite integer here, so clamping after the int conversion equals the
         * torch code's float clamp (and an integer clamp vectorizes). */
        for (int64_t i = 0; i < len; i++) {
            int32_t q = (int32_t)floorf(t[i]);
            q = q < ilo ? ilo : q;
            q = q > qmax ? qmax : q;
            c[i] = (uint8_t)(q + bias);
        }
    }
}

/* encode_window for learned levels (codec/levels.py): scale = absmax or max - min (a zero stored
 * as +0), t = (x * f) * (1 / (s * f)) or ((x - min) * f) * (1 / (s * f)) with s the scale (1 if
 * zero) and f as in encode_window, clamped to the table's domain, k = the last level <= t among
 * L[0 .. K-2] (binary search), d = t - L[k], gap = L[k+1] - L[k], code k + (u * gap < d) or
 * k + (d + d >= gap): no division per element. */
static void encode_window_levels(float *v, int64_t n, const spec_t *s, const float *lv,
                                 int64_t w0, int64_t w1, int stochastic, uint32_t k0,
                                 uint32_t k1, uint32_t ctr0, uint8_t *row, uint8_t *codes) {
    int64_t G = num_groups(n, s->gs);
    int K = 1 << s->bits;
    float dlo = s->symmetric ? -1.0f : 0.0f;
    for (int64_t g0 = w0; g0 < w1; g0 += s->gs) {
        int64_t g = g0 / s->gs, len = (g0 + s->gs < w1 ? g0 + s->gs : w1) - g0;
        float *x = v + (g0 - w0);
        uint8_t *c = codes + (g0 - w0);
        float mn, mx, scale, mins = 0.0f;
        if (group_bounds(x, len, s, row, G, g, c, 0, &mn, &mx)) continue;
        if (s->symmetric) {
            float amax = mx > -mn ? mx : -mn;
            scale = amax + 0.0f;
        } else {
            mins = mn + 0.0f;
            scale = (mx - mins) + 0.0f;
        }
        memcpy(row + 4 * g, &scale, 4);
        if (!s->symmetric) memcpy(row + 4 * (G + g), &mins, 4);
        float safe = scale == 0.0f ? 1.0f : scale;
        float f;
        float r = group_reciprocal(safe, &f);
        uint32_t ctr = ctr0 + (uint32_t)(g0 - w0), h = 0;
        for (int64_t i = 0; i < len; i++) {
            float t = ((s->symmetric ? x[i] : x[i] - mins) * f) * r;
            t = t < dlo ? dlo : t;
            t = t > 1.0f ? 1.0f : t;
            int k = 0;
            for (int step = K >> 1; step > 0; step >>= 1) {
                int cand = k + step;
                if (cand <= K - 2 && lv[cand] <= t) k = cand;
            }
            float d = t - lv[k], gap = lv[k + 1] - lv[k];
            int up;
            if (stochastic) {
                if (!(i & 1)) h = pair_hash(ctr + (uint32_t)i, k0, k1); /* i starts even */
                up = pair_uniform(h, (int)(i & 1)) * gap < d;
            } else {
                up = d + d >= gap;
            }
            c[i] = (uint8_t)(k + up);
        }
    }
}

/* Source of an encode: x (- ref) zero-padded to n, or the in-order sum of k decoded wire rows. */
typedef struct {
    const float *x;
    int64_t x_stride;
    const float *ref;
    int64_t ref_stride;
    int64_t n0; /* valid columns of x; columns [n0, n) are zeros */
    const uint8_t *const *chunks;
    const int64_t *chunk_strides;
    int k;
    spec_t in;
} source_t;

static void fill_window(const source_t *src, int64_t r, int64_t w0, int64_t w1, int64_t n,
                        float *v, uint8_t *codes) {
    if (src->k) {
        for (int j = 0; j < src->k; j++)
            decode_window(src->chunks[j] + r * src->chunk_strides[j], n, &src->in, w0, w1, v,
                          j > 0, codes);
        return;
    }
    int64_t e = w1 < src->n0 ? w1 : src->n0;
    const float *x = src->x + r * src->x_stride;
    if (src->ref) {
        const float *f = src->ref + r * src->ref_stride;
        for (int64_t i = w0; i < e; i++) v[i - w0] = x[i] - f[i];
    } else if (e > w0) {
        memcpy(v, x + w0, (size_t)(e - w0) * 4);
    }
    for (int64_t i = e > w0 ? e : w0; i < w1; i++) v[i - w0] = 0.0f;
}

/* A window's scratch: W fp32 values and W (+ 8 padding) codes. */
typedef struct {
    float *v;
    uint8_t *codes;
} window_t;

static int window_alloc(window_t *w, int64_t W) {
    w->v = malloc((size_t)W * 4);
    w->codes = malloc((size_t)W + 8);
    if (w->v && w->codes) return 0;
    free(w->v);
    free(w->codes);
    return -1;
}

static void window_free(window_t *w) {
    free(w->v);
    free(w->codes);
}

/* Encode `rows` rows of n values from src into out (row stride out_stride bytes). hadamard:
 * rotate each 32-block first (n a multiple of 32). Returns 0, or -1 when out of memory. */
static int encode_rows(const source_t *src, int64_t rows, int64_t n, const spec_t *s,
                       const float *levels, int hadamard, int stochastic, uint32_t k0,
                       uint32_t k1, uint8_t *out, int64_t out_stride) {
    int64_t W = window_len(s->gs, src->k ? src->in.gs : 1);
    window_t win;
    if (window_alloc(&win, W)) return -1;
    float *v = win.v;
    uint8_t *codes = win.codes;
    int64_t tb = table_bytes(s);
    int64_t coff = code_offset(n, s);
    int64_t cbytes = (n + 7) / 8 * s->bits;
    int64_t total = coff + cbytes, padded = (total + 3) / 4 * 4;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = out + r * out_stride + tb; /* the scale section */
        if (levels) memcpy(out + r * out_stride, levels, (size_t)tb);
        memset(row + total, 0, (size_t)(padded - total));
        for (int64_t w0 = 0; w0 < n; w0 += W) {
            int64_t w1 = w0 + W < n ? w0 + W : n;
            uint32_t ctr0 = (uint32_t)(r * n + w0);
            fill_window(src, r, w0, w1, n, v, codes);
            if (hadamard) hadamard32(v, w1 - w0);
            if (levels)
                encode_window_levels(v, n, s, levels, w0, w1, stochastic, k0, k1, ctr0, row,
                                     codes);
            else
                encode_window(v, n, s, w0, w1, stochastic, k0, k1, ctr0, row, codes);
            int64_t cnt = (w1 - w0 + 7) / 8 * 8;
            for (int64_t i = w1 - w0; i < cnt; i++) codes[i] = 0; /* padding encodes as 0 */
            pack(codes, cnt, s->bits, row + coff + w0 / 8 * s->bits);
        }
    }
    window_free(&win);
    return 0;
}

int fq_encode(const float *x, int64_t x_stride, const float *ref, int64_t ref_stride,
              int64_t rows, int64_t n0, int64_t n, int bits, int64_t gs, int symmetric,
              int hadamard, int stochastic, uint32_t k0, uint32_t k1, uint8_t *out,
              int64_t out_stride) {
    source_t src = {x, x_stride, ref, ref_stride, n0, NULL, NULL, 0, {0, 0, 0, 0}};
    spec_t s = {bits, gs, symmetric, 0};
    return encode_rows(&src, rows, n, &s, NULL, hadamard, stochastic, k0, k1, out, out_stride);
}

/* Learned levels: rows of x (n values, row stride x_stride) on the table levels[2^bits]. */
int fq_encode_levels(const float *x, int64_t x_stride, int64_t rows, int64_t n, int bits,
                     int64_t gs, int symmetric, int stochastic, uint32_t k0, uint32_t k1,
                     const float *levels, uint8_t *out, int64_t out_stride) {
    source_t src = {x, x_stride, NULL, 0, n, NULL, NULL, 0, {0, 0, 0, 0}};
    spec_t s = {bits, gs, symmetric, 1};
    return encode_rows(&src, rows, n, &s, levels, 0, stochastic, k0, k1, out, out_stride);
}

int fq_reduce_requantize(const uint8_t *const *chunks, const int64_t *chunk_strides, int k,
                         int64_t rows, int64_t n, int bits_in, int64_t gs_in, int symmetric_in,
                         int bits, int64_t gs, int symmetric, int stochastic, uint32_t k0,
                         uint32_t k1, uint8_t *out, int64_t out_stride) {
    source_t src = {NULL, 0, NULL, 0, n, chunks, chunk_strides, k,
                    {bits_in, gs_in, symmetric_in, 0}};
    spec_t s = {bits, gs, symmetric, 0};
    return encode_rows(&src, rows, n, &s, NULL, 0, stochastic, k0, k1, out, out_stride);
}

/* Sum over k wire rows (in order) of their decoded values; hadamard: then H32 / 32 and keep
 * the first n_out; written to (accumulate: added into) out[r * out_stride + i], i < n_out.
 * learned: learned-levels rows; with accumulate the sum is formed first, then added. */
static int decode_sum(const uint8_t *const *chunks, const int64_t *chunk_strides, int k,
                      int64_t rows, int64_t n, int64_t n_out, const spec_t *s, int hadamard,
                      int accumulate, float *out, int64_t out_stride) {
    int64_t W = window_len(s->gs, 1);
    window_t win;
    if (window_alloc(&win, W)) return -1;
    float *v = win.v;
    uint8_t *codes = win.codes;
    int sum_first = hadamard || (s->learned && accumulate);
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * out_stride;
        for (int64_t w0 = 0; w0 < n; w0 += W) {
            int64_t w1 = w0 + W < n ? w0 + W : n;
            if (!sum_first) {
                for (int j = 0; j < k; j++)
                    decode_window(chunks[j] + r * chunk_strides[j], n, s, w0, w1, o + w0,
                                  accumulate || j > 0, codes);
                continue;
            }
            for (int j = 0; j < k; j++)
                decode_window(chunks[j] + r * chunk_strides[j], n, s, w0, w1, v, j > 0, codes);
            int64_t e = w1 < n_out ? w1 : n_out;
            if (!hadamard) {
                for (int64_t i = w0; i < e; i++) o[i] = o[i] + v[i - w0];
                continue;
            }
            hadamard32(v, w1 - w0);
            if (accumulate)
                for (int64_t i = w0; i < e; i++) o[i] = o[i] + v[i - w0] * (1.0f / 32);
            else
                for (int64_t i = w0; i < e; i++) o[i] = v[i - w0] * (1.0f / 32);
        }
    }
    window_free(&win);
    return 0;
}

int fq_decode_sum(const uint8_t *const *chunks, const int64_t *chunk_strides, int k,
                  int64_t rows, int64_t n, int64_t n_out, int bits, int64_t gs, int symmetric,
                  int hadamard, int accumulate, float *out, int64_t out_stride) {
    spec_t s = {bits, gs, symmetric, 0};
    return decode_sum(chunks, chunk_strides, k, rows, n, n_out, &s, hadamard, accumulate, out,
                      out_stride);
}

int fq_decode_levels_sum(const uint8_t *const *chunks, const int64_t *chunk_strides, int k,
                         int64_t rows, int64_t n, int bits, int64_t gs, int symmetric,
                         int accumulate, float *out, int64_t out_stride) {
    spec_t s = {bits, gs, symmetric, 1};
    return decode_sum(chunks, chunk_strides, k, rows, n, n, &s, 0, accumulate, out, out_stride);
}

/* The change tracker's exact shard digest (fsdp/change_tracker.shard_digests) in one pass:
 * sum over i of (the raw bits of x[i], sign-extended to 64 bits) * ((off + i) % 65521 + 1),
 * modulo 2^64 (unsigned arithmetic wraps as torch's int64 sum does). elem_bytes: 2, 4 or 8.
 * Taken in runs over which the weight does not wrap (w0, w0 + 1, ...): a run adds
 * w0 * sum(v) + sum(v * j), the same value modulo 2^64, with no branch in the inner loops,
 * which the compiler vectorizes (a widening 32 x 32 -> 64-bit multiply for 2- and 4-byte
 * values, whose v * j < 2^47 cannot overflow). */
#define FQ_DIGEST_RUN(T)                                                           \
    do {                                                                           \
        const T *p = (const T *)x + i;                                             \
        for (int32_t j = 0; j < (int32_t)len; j++) {                               \
            s += (uint64_t)(int64_t)p[j];                                          \
            sj += (uint64_t)((int64_t)p[j] * (int64_t)j);                          \
        }                                                                          \
    } while (0)

uint64_t fq_digest(const void *x, int elem_bytes, int64_t n, int64_t off) {
    const int64_t P = 65521;
    int64_t w0 = off % P + 1;
    uint64_t acc = 0;
    for (int64_t i = 0; i < n;) {
        int64_t len = P - w0 + 1;
        if (len > n - i) len = n - i;
        uint64_t s = 0, sj = 0;
        if (elem_bytes == 4) FQ_DIGEST_RUN(int32_t);
        else if (elem_bytes == 2) FQ_DIGEST_RUN(int16_t);
        else {
            const int64_t *p = (const int64_t *)x + i;
            for (int64_t j = 0; j < len; j++) {
                s += (uint64_t)p[j];
                sj += (uint64_t)p[j] * (uint64_t)j;
            }
        }
        acc += (uint64_t)w0 * s + sj;
        i += len;
        w0 = 1;
    }
    return acc;
}
#undef FQ_DIGEST_RUN
