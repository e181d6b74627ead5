// AWQ GEMM-layout int4 matmul for a few rows (decode): y = x @ W, W = (q - zero) * scale,
// read straight from the checkpoint's tensors, never dequantized into memory; and, for more
// rows than that pays for, ``awq_dequantize``: a block of W in float32 for BLAS.
//
// Layout (see format.py): qweight [in, out/8] int32 and qzeros [groups, out/8] int32, nibble n
// of word j holding packed column 8j + n; scales [groups, out] float16 in column order.
// ``logical`` maps a packed column to its column (AWQ interleaves them); the output is in
// column order.
//
// Per group, the sum over the group's inputs of x_i * q_i is accumulated first and scaled
// once: y[m, c] = sum_g scale[g, c] * (sum_{i in g} x[m, i] q[i, c] - zero[g, c] * sum_{i in g} x[m, i]).
// Zero points and scales are read from their packed tensors as each group is finished, so
// nothing has to be derived from them beforehand (layer streaming stages the raw tensors).
// Each output's sums run in a fixed order whatever the row count, register tile or thread
// split, so a row's result does not depend on what it is batched with.
//
// Speed (benchmarks/awq_kernel.py, SmolLM2's shapes, 2 Zen 3 cores): the weights are read
// group by group, each group's words unpacked in registers into R rows x W words of 8-lane
// accumulators that stay there for the whole group (4 x 2, 2 x 4 or 1 x 8 words); one row
// takes 0.4-0.8x the float32 layer's time, eight rows 1.1-1.3x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Register-tiled paths: the accumulators of a tile stay in registers for a whole group (an
// earlier version kept them in memory and paid a load and a store per 8 weights). Every loop
// over a tile's accumulators is unrolled: one left rolled makes GCC keep the whole array in
// memory and store it on every iteration of the inner loop (seen in the disassembly: it
// halved the kernel's speed).
#define UNROLL _Pragma("GCC unroll 16")

// How far down a block's column of words the paths ask for lines ahead of use.
constexpr int64_t kRowsAhead = 64;

// Asks for the cache line of ``address`` into L2. KVSTREAM_NO_PREFETCH: the build
// benchmarks/awq_kernel.py compares against (its ``no prefetch`` column).
template <typename T>
static inline void prefetch_l2(const T* address) {
#if !defined(KVSTREAM_NO_PREFETCH)
    _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T1);
#endif
}

// ``shifts`` puts column 8j + c's nibble in lane c, so accumulators, scales, zero points and
// y line up in column order and the per-group epilogue is vector code.
static inline __m256 nibbles_of(int32_t word, __m256i shifts) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(0xF)));
}

#if defined(__AVX512VL__)
// Built for AVX-512 (native.py): a weight's nibble n becomes the float 1 + n/16 without a
// conversion: moved to mantissa bits 19-22, one ternary-logic op keeps those bits and sets
// the exponent of 1.0 ((a & mask) | one), exact. The one-row kernel is bound by the vector
// operations that unpack a nibble (shift, mask, convert: the fused multiply-add is the
// fourth), and this takes one of them away: SmolLM2's projections at one row 1.11-1.20x, in
// cache and from memory; four rows 1.00x, eight 0.93-0.96x (a later A/B: 1.08x in cache,
// 0.95x from memory, before the tiles prefetched; the cause of the from-memory loss is not
// known: the tiles run fewer vector operations this way) (same-process A/Bs of the two
// builds; benchmarks/awq_kernel.py's ``no avx512`` column, noisier). The accumulator then holds
// sum x (1 + n/16) = xsum + (sum x n) / 16, and ``add_group`` takes 16 acc - xsum (16 + zero):
// every path of this build computes so, so a row still gets the same bits alone and batched
// (a build without AVX-512 rounds differently, in the last bits).
static inline __m256 one_plus_sixteenth(__m256i nibble_at_bit_19) {
    return _mm256_castsi256_ps(_mm256_ternarylogic_epi32(nibble_at_bit_19, _mm256_set1_epi32(0xF << 19),
                                                          _mm256_set1_epi32(0x3F800000), 0xEA));  // (a & b) | c
}
#endif

// The weights' nibbles for ``awq_tile``: n (``unpack``: ``shifts``), or under AVX-512 1 + n/16
// (see above; ``unpack``: ``weight_unpacking(shifts)``, the rotations that take each lane's
// nibble to bits 19-22).
static inline __m256i weight_unpacking(__m256i shifts) {
#if defined(__AVX512VL__)
    return _mm256_and_si256(_mm256_sub_epi32(_mm256_set1_epi32(19), shifts), _mm256_set1_epi32(31));
#else
    return shifts;
#endif
}

static inline __m256 weight_nibbles(int32_t word, __m256i unpack) {
#if defined(__AVX512VL__)
    return one_plus_sixteenth(_mm256_rolv_epi32(_mm256_set1_epi32(word), unpack));
#else
    return nibbles_of(word, unpack);
#endif
}

// y[8j .. 8j + 8) += (acc - zero * xsum) * scale: group g's share of word j's eight columns
// (under AVX-512 acc holds sum x (1 + n/16): (16 acc - (16 + zero) xsum) * scale, the
// factors of 16 exact). Fused multiply-adds written out, so that no compiler choice about
// contracting them can make one call site round differently from another.
static inline void add_group(const __m256 acc, float xsum, __m256 zero, __m256 scale, float* y) {
#if defined(__AVX512VL__)
    const __m256 sixteen = _mm256_set1_ps(16.f);
    const __m256 centred = _mm256_fnmadd_ps(_mm256_add_ps(zero, sixteen), _mm256_set1_ps(xsum), _mm256_mul_ps(acc, sixteen));
#else
    const __m256 centred = _mm256_fnmadd_ps(zero, _mm256_set1_ps(xsum), acc);
#endif
    _mm256_storeu_ps(y, _mm256_fmadd_ps(centred, scale, _mm256_loadu_ps(y)));
}

static inline __m256 group_scale(const at::Half* s, int64_t out, int64_t g, int64_t j) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + g * out + j * 8)));
}

// The shifts that bring column 8j + c's nibble to lane c, and in ``nibble_of[c]`` the nibble
// that holds column offset c: the same for every word in AWQ's layout, which is checked
// rather than assumed (``logical``: packed column -> column, ``out`` of them).
static __m256i column_shifts(const int64_t* lp, int64_t out, int32_t* nibble_of) {
    int32_t shift[8];
    for (int n = 0; n < 8; ++n) {
        TORCH_CHECK(lp[n] >= 0 && lp[n] < 8, "logical must permute each word's eight columns");
        shift[lp[n]] = 4 * n;
        nibble_of[lp[n]] = n;
    }
    for (int64_t p = 0; p < out; ++p)
        TORCH_CHECK(lp[p] == (p / 8) * 8 + lp[p % 8], "logical must permute each word's columns the same way");
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(shift));
}

// Group g of R rows of x times words [j0, j0 + W): each word is broadcast and unpacked once
// for all R rows (variable shifts), R x W accumulators.
template <int R, int W>
static inline void awq_tile(const float* x, const float* xs, int64_t in, int64_t groups, const int32_t* q,
                            const int32_t* z, const at::Half* s, int64_t words, int64_t group_size, int64_t j0,
                            int64_t g, __m256i shifts, float* y, int64_t out) {
    __m256 acc[R][W];
    const __m256i unpack = weight_unpacking(shifts);
    UNROLL for (int r = 0; r < R; ++r)
        UNROLL for (int w = 0; w < W; ++w) acc[r][w] = _mm256_setzero_ps();
    // As ``awq_row8`` does, the words kRowsAhead inputs down are asked for into L2, by the
    // first tile of each cache line's 16 words only (a line feeds 16 / W tiles). Over 30 of
    // SmolLM2's layers' projections from memory (same-process A/B of the two builds, best of
    // 21, two runs): 2 rows 1.29-1.42x, 4 rows 1.20-1.26x, 8 rows 1.11-1.12x, 16 rows
    // 1.02-1.13x; in cache 0.97-1.01x. Before it, the tiles read each line on demand: one
    // layer's 8 rows took 1.7x as long from memory as from cache.
    const bool lead = R > 1 && j0 % 16 == 0;
    for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        if (lead) prefetch_l2(q + std::min(i + kRowsAhead, in - 1) * words + j0);
        __m256 xv[R];
        UNROLL for (int r = 0; r < R; ++r) xv[r] = _mm256_broadcast_ss(x + r * in + i);
        const int32_t* row = q + i * words + j0;
        UNROLL for (int w = 0; w < W; ++w) {
            const __m256 qv = weight_nibbles(row[w], unpack);
            UNROLL for (int r = 0; r < R; ++r) acc[r][w] = _mm256_fmadd_ps(qv, xv[r], acc[r][w]);
        }
    }
    UNROLL for (int w = 0; w < W; ++w) {
        const __m256 zero = nibbles_of(z[g * words + j0 + w], shifts), scale = group_scale(s, out, g, j0 + w);
        UNROLL for (int r = 0; r < R; ++r) add_group(acc[r][w], xs[r * groups + g], zero, scale, y + r * out + (j0 + w) * 8);
    }
}

// The same for one row and eight words, unpacked the other way round: the eight words are
// loaded as one vector and nibble n of all of them taken with one constant shift (cheaper
// than a variable shift per word), accumulators in nibble order (acc[n] lane w: word w's
// nibble n), put in column order once per group (``nibble_of``: lane c takes the nibble that
// holds column offset c). Each accumulator runs the same fused multiply-adds in the same
// order as in ``awq_tile``: results are bit-identical.
static inline void awq_row8(const float* x, float xsum, const int32_t* q, const int32_t* z, const at::Half* s,
                            int64_t in, int64_t words, int64_t group_size, int64_t j0, int64_t g, __m256i shifts,
                            __m256i nibble_of, float* y, int64_t out) {
#if !defined(__AVX512VL__)
    const __m256i low = _mm256_set1_epi32(0xF);
#endif
    __m256 acc[8];
    UNROLL for (int n = 0; n < 8; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x + i);
        // This block's words kRowsAhead inputs down, into L2: walking a group column-wise,
        // one input's words at a stride of the row, the hardware prefetcher falls behind.
        // Rows past the group's end are the next group's, which reaches this block a whole
        // group later: still in L2 (a thread's share of a group is at most ~100 KB). Asking
        // for the next cache line of the same input instead (T0) left the first block of every
        // group and every narrow projection to demand misses: 96 layers' projections from
        // memory 16.8 -> 15.1 ms a token (same-process A/B of the two builds over the
        // 96-layer checkpoint of benchmarks/awq_streaming.py, best of 21; 10.6 -> 10.4 ms
        // hot). ``awq_tile`` does the same for more rows.
        prefetch_l2(q + std::min(i + kRowsAhead, in - 1) * words + j0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * words + j0));
#if defined(__AVX512VL__)
        // Nibble n of every word moved to bits 19-22 with one constant shift each.
        acc[0] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_slli_epi32(v, 19)), xv, acc[0]);
        acc[1] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_slli_epi32(v, 15)), xv, acc[1]);
        acc[2] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_slli_epi32(v, 11)), xv, acc[2]);
        acc[3] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_slli_epi32(v, 7)), xv, acc[3]);
        acc[4] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_slli_epi32(v, 3)), xv, acc[4]);
        acc[5] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_srli_epi32(v, 1)), xv, acc[5]);
        acc[6] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_srli_epi32(v, 5)), xv, acc[6]);
        acc[7] = _mm256_fmadd_ps(one_plus_sixteenth(_mm256_srli_epi32(v, 9)), xv, acc[7]);
#else
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), xv, acc[0]);
        acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), low)), xv, acc[1]);
        acc[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), low)), xv, acc[2]);
        acc[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 12), low)), xv, acc[3]);
        acc[4] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), low)), xv, acc[4]);
        acc[5] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 20), low)), xv, acc[5]);
        acc[6] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 24), low)), xv, acc[6]);
        acc[7] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28)), xv, acc[7]);
#endif
    }
    // Transposed in registers (by_word[w] lane n = acc[n] lane w), then each word's lanes
    // permuted into column order. Through memory (eight stores, 64 scalar moves, eight loads
    // of what those moves stored, which store forwarding cannot serve) this took 15-20% of
    // the kernel's time at one row, from L2.
    const __m256 t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
    const __m256 t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
    const __m256 t4 = _mm256_unpacklo_ps(acc[4], acc[5]), t5 = _mm256_unpackhi_ps(acc[4], acc[5]);
    const __m256 t6 = _mm256_unpacklo_ps(acc[6], acc[7]), t7 = _mm256_unpackhi_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 by_word[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
    UNROLL for (int w = 0; w < 8; ++w)
        add_group(_mm256_permutevar8x32_ps(by_word[w], nibble_of), xsum, nibbles_of(z[g * words + j0 + w], shifts),
                  group_scale(s, out, g, j0 + w), y + (j0 + w) * 8);
}

// Group g of rows [0, R) of x against words [first, last): W words at a time, then one at a
// time.
template <int R, int W>
static inline void awq_rows(const float* x, const float* xs, int64_t in, int64_t groups, const int32_t* q,
                            const int32_t* z, const at::Half* s, int64_t words, int64_t group_size, int64_t first,
                            int64_t last, int64_t g, __m256i shifts, __m256i nibble_of, float* y, int64_t out) {
    int64_t j = first;
    if (R == 1)
        for (; j + 8 <= last; j += 8) awq_row8(x, xs[g], q, z, s, in, words, group_size, j, g, shifts, nibble_of, y, out);
    for (; j + W <= last; j += W) awq_tile<R, W>(x, xs, in, groups, q, z, s, words, group_size, j, g, shifts, y, out);
    for (; j < last; ++j) awq_tile<R, 1>(x, xs, in, groups, q, z, s, words, group_size, j, g, shifts, y, out);
}
#endif

// One projection of a call: its packed tensors (contiguous) and its output.
struct Projection {
    const int32_t* q;
    const int32_t* z;
    const at::Half* s;
    const int64_t* logical;
    int64_t words, out;
    float* y;
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Words [first, last) of one projection, every group and row: a thread's share of it.
static void awq_words(const Projection& p, const float* xp, const float* xs, int64_t rows, int64_t in, int64_t groups,
                      int64_t group_size, int64_t first, int64_t last, __m256i shifts, __m256i nibble_order) {
    // The in-loop prefetches ask for each block's words kRowsAhead inputs down, so the
    // first kRowsAhead inputs of every block would come from memory on demand; ask for
    // all of them now, before the first group (same A/B as ``awq_row8``'s prefetch, one
    // row, 96 layers from memory: 17.5 -> 16.7 and 23.5 -> 22.0 ms a token in two runs of
    // different load).
    for (int64_t i = 0; i < std::min(in, kRowsAhead); ++i) {
        for (int64_t j = first; j < last; j += 16)  // 16 words: a cache line
            prefetch_l2(p.q + i * p.words + j);
        prefetch_l2(p.q + i * p.words + last - 1);
    }
    // Group by group, so that a group's packed words are read from memory once, in runs of
    // (last - first) words, and stay in L1 for every row and tile that needs them.
    for (int64_t g = 0; g < groups; ++g) {
        int64_t m = 0;
        for (; m + 4 <= rows; m += 4)
            awq_rows<4, 2>(xp + m * in, xs + m * groups, in, groups, p.q, p.z, p.s, p.words, group_size, first, last, g, shifts, nibble_order, p.y + m * p.out, p.out);
        for (; m + 2 <= rows; m += 2)
            awq_rows<2, 4>(xp + m * in, xs + m * groups, in, groups, p.q, p.z, p.s, p.words, group_size, first, last, g, shifts, nibble_order, p.y + m * p.out, p.out);
        for (; m < rows; ++m)
            awq_rows<1, 8>(xp + m * in, xs + m * groups, in, groups, p.q, p.z, p.s, p.words, group_size, first, last, g, shifts, nibble_order, p.y + m * p.out, p.out);
    }
}
#else
// Plain C++ (no AVX2): columns in tiles whose accumulators (rows x tile) stay within L1.
static void awq_words(const Projection& p, const float* xp, const float* xs, int64_t rows, int64_t in, int64_t groups,
                      int64_t group_size, int64_t first, int64_t last) {
    const int64_t tile = std::max<int64_t>(1, 512 / rows);
    std::vector<float> acc(rows * std::min(tile, last - first) * 8);
    for (int64_t begin = first; begin < last; begin += tile) {
        const int64_t end = std::min(last, begin + tile);
        const int64_t width = (end - begin) * 8;
        for (int64_t g = 0; g < groups; ++g) {
            std::fill(acc.begin(), acc.begin() + rows * width, 0.0f);
            for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
                const int32_t* row = p.q + i * p.words;
                for (int64_t j = begin; j < end; ++j) {
                    const uint32_t word = static_cast<uint32_t>(row[j]);
                    for (int64_t m = 0; m < rows; ++m) {
                        const float xi = xp[m * in + i];
                        float* am = acc.data() + m * width + (j - begin) * 8;
                        for (int n = 0; n < 8; ++n) am[n] += xi * static_cast<float>((word >> (4 * n)) & 0xF);
                    }
                }
            }
            for (int64_t o = 0; o < width; ++o) {
                const int64_t packed = begin * 8 + o, column = p.logical[packed];
                const float scale = static_cast<float>(p.s[g * p.out + column]);
                const float zero = static_cast<float>((static_cast<uint32_t>(p.z[g * p.words + packed / 8]) >> (4 * (packed % 8))) & 0xF);
                for (int64_t m = 0; m < rows; ++m)
                    p.y[m * p.out + column] += (acc[m * width + o] - zero * xs[m * groups + g]) * scale;
            }
        }
    }
}
#endif

// x [rows, in] times several projections of the same input (a layer's Q, K and V; gate and
// up), one output each, in one parallel region: the threads split the projections' words
// together, so a narrow projection (K, V: three units of 8 words) does not leave a thread
// idle, and a layer pays one call and one team barrier where it paid three: a SmolLM2 AWQ
// decode step 1.06x at batch 1 and at batch 8 (benchmarks/fast_decoder.py, ``fused``). Each
// output is the one its projection alone gives, bit for bit (its sums do not depend on the split).
std::vector<torch::Tensor> awq_gemv_many(torch::Tensor x, std::vector<torch::Tensor> qweights, std::vector<torch::Tensor> qzeros,
                                         std::vector<torch::Tensor> scales, std::vector<torch::Tensor> logicals, int64_t group_size) {
    TORCH_CHECK(x.dtype() == torch::kFloat32, "x must be float32");
    const size_t count = qweights.size();
    TORCH_CHECK(count > 0 && qzeros.size() == count && scales.size() == count && logicals.size() == count,
                "one qweight, qzeros, scales and logical per projection");
    x = x.contiguous();
    const int64_t rows = x.size(0), in = qweights[0].size(0);
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in && group_size > 0 && in % group_size == 0, "shape mismatch");
    const int64_t groups = in / group_size;
    std::vector<torch::Tensor> outputs;
    std::vector<Projection> projections;
    for (size_t k = 0; k < count; ++k) {
        TORCH_CHECK(qweights[k].dtype() == torch::kInt32 && qzeros[k].dtype() == torch::kInt32, "qweight and qzeros must be int32");
        TORCH_CHECK(scales[k].dtype() == torch::kFloat16, "scales must be float16");
        TORCH_CHECK(logicals[k].dtype() == torch::kInt64, "logical must be int64");
        qweights[k] = qweights[k].contiguous();  // the vectors keep any copy alive for the call
        qzeros[k] = qzeros[k].contiguous();
        scales[k] = scales[k].contiguous();
        logicals[k] = logicals[k].contiguous();
        const int64_t words = qweights[k].size(1), out = words * 8;
        TORCH_CHECK(qweights[k].dim() == 2 && qweights[k].size(0) == in, "shape mismatch");
        TORCH_CHECK(qzeros[k].size(0) == groups && qzeros[k].size(1) == words && scales[k].size(0) == groups && scales[k].size(1) == out
                    && logicals[k].numel() == out, "qzeros / scales / logical shape mismatch");
        outputs.push_back(torch::empty({rows, out}, x.options()));  // zeroed below: cheaper than a zeros op
        projections.push_back({qweights[k].data_ptr<int32_t>(), qzeros[k].data_ptr<int32_t>(), scales[k].data_ptr<at::Half>(),
                               logicals[k].data_ptr<int64_t>(), words, out, outputs.back().data_ptr<float>()});
    }
    if (rows == 0) return outputs;
    const float* xp = x.data_ptr<float>();
    // Each row's sum over each group, left to right (plain C++ rather than a torch op: at
    // decode sizes the op's dispatch cost more than the sums).
    std::vector<float> xsum(rows * groups);
    for (int64_t m = 0; m < rows * groups; ++m) {
        float total = 0.0f;
        for (int64_t i = 0; i < group_size; ++i) total += xp[m * group_size + i];
        xsum[m] = total;
    }
    const float* xs = xsum.data();
    // Units of 8 words (64 columns), numbered through the projections in turn.
    std::vector<int64_t> first_unit(count + 1, 0);
    for (size_t k = 0; k < count; ++k) {
        std::fill(projections[k].y, projections[k].y + rows * projections[k].out, 0.0f);
        first_unit[k + 1] = first_unit[k] + (projections[k].words + 7) / 8;
    }
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    std::vector<__m256i> shifts(count), nibble_order(count);
    for (size_t k = 0; k < count; ++k) {
        int32_t nibble_of[8];
        shifts[k] = column_shifts(projections[k].logical, projections[k].out, nibble_of);
        nibble_order[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibble_of));
    }
#endif
    // A thread's units, projection by projection; within one, rows 4, 2 or 1 at a time:
    // register tiles of 4 rows x 2 words, 2 x 4 or 1 x 8.
    at::parallel_for(0, first_unit[count], 1, [&](int64_t begin, int64_t end) {
        for (size_t k = 0; k < count; ++k) {
            const int64_t u0 = std::max(begin, first_unit[k]), u1 = std::min(end, first_unit[k + 1]);
            if (u0 >= u1) continue;
            const int64_t first = (u0 - first_unit[k]) * 8, last = std::min(projections[k].words, (u1 - first_unit[k]) * 8);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            awq_words(projections[k], xp, xs, rows, in, groups, group_size, first, last, shifts[k], nibble_order[k]);
#else
            awq_words(projections[k], xp, xs, rows, in, groups, group_size, first, last);
#endif
        }
    });
    return outputs;
}

torch::Tensor awq_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                       torch::Tensor logical, int64_t group_size) {
    return awq_gemv_many(x, {qweight}, {qzeros}, {scales}, {logical}, group_size)[0];
}

// Words [first, last) of the weights as float32 ``(q - zero) * scale``, [in, 8 * (last - first)]
// in column order, written into ``buffer`` (reused by the caller): for prefill chunks and
// large batches, which BLAS then multiplies. One pass over the packed words, where the
// pure-torch path takes several over a float copy.
torch::Tensor awq_dequantize(torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales, torch::Tensor logical,
                             int64_t group_size, int64_t first, int64_t last, torch::Tensor buffer) {
    TORCH_CHECK(qweight.dtype() == torch::kInt32 && qzeros.dtype() == torch::kInt32, "qweight and qzeros must be int32");
    TORCH_CHECK(scales.dtype() == torch::kFloat16, "scales must be float16");
    TORCH_CHECK(logical.dtype() == torch::kInt64 && buffer.dtype() == torch::kFloat32, "logical must be int64, buffer float32");
    TORCH_CHECK(buffer.is_contiguous(), "buffer must be contiguous");
    qweight = qweight.contiguous();
    qzeros = qzeros.contiguous();
    scales = scales.contiguous();
    logical = logical.contiguous();
    const int64_t in = qweight.size(0), words = qweight.size(1), out = words * 8;
    TORCH_CHECK(group_size > 0 && in % group_size == 0 && 0 <= first && first < last && last <= words, "shape mismatch");
    const int64_t groups = in / group_size, width = (last - first) * 8;
    TORCH_CHECK(qzeros.size(0) == groups && qzeros.size(1) == words && scales.size(0) == groups && scales.size(1) == out
                && logical.numel() == out && buffer.numel() >= in * width, "qzeros / scales / logical / buffer shape mismatch");
    const int32_t* qp = qweight.data_ptr<int32_t>();
    const int32_t* zp = qzeros.data_ptr<int32_t>();
    const at::Half* sp = scales.data_ptr<at::Half>();
    const int64_t* lp = logical.data_ptr<int64_t>();
    float* wp = buffer.data_ptr<float>();
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    int32_t nibble_of[8];
    const __m256i shifts = column_shifts(lp, out, nibble_of);
    at::parallel_for(0, groups, 1, [&](int64_t first_group, int64_t last_group) {
        std::vector<__m256> zero(last - first), scale(last - first);
        for (int64_t g = first_group; g < last_group; ++g) {
            for (int64_t j = first; j < last; ++j) {
                zero[j - first] = nibbles_of(zp[g * words + j], shifts);
                scale[j - first] = group_scale(sp, out, g, j);
            }
            for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
                const int32_t* row = qp + i * words;
                float* target = wp + i * width;
                for (int64_t j = first; j < last; ++j)
                    _mm256_storeu_ps(target + (j - first) * 8,
                                     _mm256_mul_ps(_mm256_sub_ps(nibbles_of(row[j], shifts), zero[j - first]), scale[j - first]));
            }
        }
    });
#else
    at::parallel_for(0, groups, 1, [&](int64_t first_group, int64_t last_group) {
        for (int64_t g = first_group; g < last_group; ++g)
            for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i)
                for (int64_t p = first * 8; p < last * 8; ++p) {
                    const int64_t column = lp[p], shift = 4 * (p % 8);
                    const float q = static_cast<float>((static_cast<uint32_t>(qp[i * words + p / 8]) >> shift) & 0xF);
                    const float zero = static_cast<float>((static_cast<uint32_t>(zp[g * words + p / 8]) >> shift) & 0xF);
                    wp[i * width + column - first * 8] = (q - zero) * static_cast<float>(sp[g * out + column]);
                }
    });
#endif
    return buffer.view(-1).narrow(0, 0, in * width).view({in, width});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("awq_gemv", &awq_gemv, "AWQ int4 matmul for a few rows, from the checkpoint's tensors",
          py::call_guard<py::gil_scoped_release>());  // the server's event loop runs meanwhile
    m.def("awq_gemv_many", &awq_gemv_many, "awq_gemv for several projections of one input, one output each",
          py::call_guard<py::gil_scoped_release>());
    m.def("awq_dequantize", &awq_dequantize, "AWQ int4 weights (a range of words) as float32, in column order",
          py::call_guard<py::gil_scoped_release>());
}
