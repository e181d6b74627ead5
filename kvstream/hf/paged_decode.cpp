// Decode attention on CPU that reads K/V in place from one layer of the paged pool.
//
// Every decode query (one new token per sequence) attends to its whole context, whose slot
// j is table[j / block_size] * block_size + j % block_size in the pool. The ``sdpa`` tier
// copies each context out of the pool (index_select), then pads and masks it for SDPA; here
// each (sequence, KV head) pair walks its block table once for the scores and once for the
// values for each query head sharing that KV head (GQA), the group's rows staying in cache.
//
// Per (sequence, KV head): scores s = (q . k_j) * scale for j < length, p = softmax(s) in
// float32 (max subtracted), out = sum_j p_j v_j, with AVX2 + FMA where built for it: eight
// keys' dot products reduced together, a vector exp, the output row held in registers while
// the values stream past. Each pair's sums run in a fixed order, so a
// sequence's result does not depend on what it is batched with or on the thread split.
//
// A prefill chunk runs here as one row per token (row t over the context up to and including
// its own token), its rows taken kTileRows at a time: each tile of keys and values is read
// from memory once for all of them and used from L1 by every row, where one row at a time
// re-read the whole context per row (and lost to gather + SDPA past 8 rows). A row still runs
// exactly the operations it would alone, so the results are the same bit for bit.
//
// The pool may hold K/V in float16 or bfloat16 (``memory.kv_dtype``): values are widened to
// float32 in registers as they are read (exact), queries, sums and outputs stay float32, so a
// half pool gives exactly what its float32 copy gives (with -ffp-contract=off, which keeps
// the scalar tails' multiply and add apart in every instantiation alike).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSTREAM_AVX2 1
#endif

namespace {

#ifdef KVSTREAM_AVX2
// Sums each of 8 vectors: lane i of the result is the sum of v[i]'s lanes.
inline __m256 sum8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    // ab holds keys 0-3 in its 128-bit halves' lanes as (lo half, hi half); fold the halves.
    const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
    return _mm256_add_ps(lo, hi);
}

// exp(x) for 8 lanes (Cephes' range reduction and polynomial, ~1 ulp; x <= 0 here).
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

#ifdef KVSTREAM_AVX2
// Eight K or V values widened to float32 (exact for both half formats): the pool may hold
// them as stored in half precision, the sums always run in float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is float32's upper half
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

constexpr int64_t kTile = 32;  // keys (and values) per tile: 32 x 64 floats = 8 KB
// Rows of one sequence sharing each key and value tile (a prefill chunk's queries): enough
// that a tile read from memory serves many queries, few enough that their scores stay in L2.
constexpr int64_t kTileRows = 16;
// Long contexts are split (``split_keys``, a multiple of kTile; native_attention.SPLIT_KEYS).
// A decode's (sequence, KV head) was one unit of work: one sequence has as many units as KV
// heads (SmolLM2: 3), and two threads split three units two to one. A context past
// ``split_keys`` keys is cut at multiples of it, each piece its own unit (its own softmax
// maximum and sum), the pieces combined in order afterwards (flash-decoding's split). The
// cut depends only on a row's own length, so a row still gets the same bits alone and
// batched; a context of at most ``split_keys`` keys runs exactly as it did before.

// Rows [from, to) of a K or V tile (``rows``: their offsets) asked into L2 ahead of use. A
// unit's keys sit a block apart in a shuffled pool and a head's slice of each is a few cache
// lines: the hardware prefetcher does not follow them, and at long context the kernel waited
// on memory (8 x 2,000 tokens: 14 GB/s of K/V; with the next tile prefetched 30 GB/s; 8 x
// 6,000: 11 -> 20 GB/s). Into L2 (locality 2, prefetcht1), not L1, as native_linear.cpp found.
// KVSTREAM_NO_PREFETCH: the build benchmarks/paged_decode.py compares against.
template <typename T>
inline void prefetch_rows(const T* base, const int64_t* rows, int64_t from, int64_t to, int64_t dim) {
#if (defined(__GNUC__) || defined(__clang__)) && !defined(KVSTREAM_NO_PREFETCH)
    constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
    for (int64_t j = from; j < to; ++j)
        for (int64_t c = 0; c < dim; c += kLine) __builtin_prefetch(base + rows[j] + c, 0, 2);
#endif
}

// scores[j] = (query . key_j) * scale for j < len; key j starts at keys + rows[j].
template <typename T>
void score(const float* query, const T* keys, const int64_t* rows, int64_t len, int64_t dim, float scale, float* scores) {
    int64_t j = 0;
#ifdef KVSTREAM_AVX2
    if (dim % 8 == 0) {
        for (; j + 8 <= len; j += 8) {  // eight keys at a time, one horizontal sum for all
            const T* key[8];
            for (int k = 0; k < 8; ++k) key[k] = keys + rows[j + k];
            __m256 acc[8];
            for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 q = _mm256_loadu_ps(query + d);
                for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(q, load8(key[k] + d), acc[k]);
            }
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; j < len; ++j) {
        const T* key = keys + rows[j];
        float sum = 0.f;
        for (int64_t d = 0; d < dim; ++d) sum += query[d] * static_cast<float>(key[d]);
        scores[j] = sum * scale;
    }
}

// scores[j] = exp(scores[j] - max) for j < len; returns their sum, and the max in ``peak_out``.
float softmax_numerators(float* scores, int64_t len, float* peak_out) {
    const float peak = *std::max_element(scores, scores + len);
    *peak_out = peak;
    float total = 0.f;
    int64_t j = 0;
#ifdef KVSTREAM_AVX2
    __m256 sums = _mm256_setzero_ps();
    for (; j + 8 <= len; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(peak)));
        _mm256_storeu_ps(scores + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sums);
    for (float lane : lanes) total += lane;
#endif
    for (; j < len; ++j) {
        scores[j] = std::exp(scores[j] - peak);
        total += scores[j];
    }
    return total;
}

#ifdef KVSTREAM_AVX2
// out[0, 8 * NV) += sum_j weights[j] * value_j[0, 8 * NV), accumulated in registers.
template <int NV, typename T>
void weigh_chunk(const float* weights, const T* values, const int64_t* rows, int64_t len, float* out) {
    __m256 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
    for (int64_t j = 0; j < len; ++j) {
        const T* value = values + rows[j];
        const __m256 w = _mm256_set1_ps(weights[j]);
        for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(w, load8(value + 8 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#endif

// out[d] += sum_j weights[j] * value_j[d] for d < dim; value j starts at values + rows[j].
template <typename T>
void weigh(const float* weights, const T* values, const int64_t* rows, int64_t len, int64_t dim, float* out) {
#ifdef KVSTREAM_AVX2
    if (dim % 8 == 0) {
        for (int64_t d = 0; d < dim; d += 64) {  // 64 floats (8 registers) per pass over the values
            const T* v = values + d;
            switch (std::min<int64_t>(8, (dim - d) / 8)) {
                case 8: weigh_chunk<8, T>(weights, v, rows, len, out + d); break;
                case 7: weigh_chunk<7, T>(weights, v, rows, len, out + d); break;
                case 6: weigh_chunk<6, T>(weights, v, rows, len, out + d); break;
                case 5: weigh_chunk<5, T>(weights, v, rows, len, out + d); break;
                case 4: weigh_chunk<4, T>(weights, v, rows, len, out + d); break;
                case 3: weigh_chunk<3, T>(weights, v, rows, len, out + d); break;
                case 2: weigh_chunk<2, T>(weights, v, rows, len, out + d); break;
                default: weigh_chunk<1, T>(weights, v, rows, len, out + d); break;
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < len; ++j) {
        const T* value = values + rows[j];
        for (int64_t d = 0; d < dim; ++d) out[d] += weights[j] * static_cast<float>(value[d]);
    }
}

// Calls ``fn(k, v)`` with the pools' data as their element type: float, at::Half or
// at::BFloat16 (checked by the caller, K and V alike).
template <typename F>
void with_pool_type(torch::Tensor& k_pool, torch::Tensor& v_pool, F&& fn) {
    if (k_pool.dtype() == torch::kFloat16)
        fn(k_pool.data_ptr<at::Half>(), v_pool.data_ptr<at::Half>());
    else if (k_pool.dtype() == torch::kBFloat16)
        fn(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
    else
        fn(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
}

}  // namespace

// q [B, H_q, D] float32; k_pool / v_pool [slots, H_kv, D] float32 (D contiguous; the pool's
// layer view); tables [B, W] int32 block ids; lengths [B] int32 context lengths (the new
// token included, already written to the pool). Returns [B, H_q, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lengths, int64_t block_size, double scale, int64_t split_keys) {
    TORCH_CHECK(q.dtype() == torch::kFloat32, "paged_decode takes float32 queries");
    TORCH_CHECK(k_pool.dtype() == v_pool.dtype() && (k_pool.dtype() == torch::kFloat32 || k_pool.dtype() == torch::kFloat16
                || k_pool.dtype() == torch::kBFloat16), "paged_decode reads float32, float16 or bfloat16 pools, K and V alike");
    TORCH_CHECK(tables.dtype() == torch::kInt32 && lengths.dtype() == torch::kInt32, "tables and lengths must be int32");
    TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3 && tables.dim() == 2 && lengths.dim() == 1,
                "expected q [B, H_q, D], pools [slots, H_kv, D], tables [B, W], lengths [B]");
    TORCH_CHECK(!q.is_cuda() && !k_pool.is_cuda() && !v_pool.is_cuda(), "paged_decode runs on CPU tensors");
    TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.stride(2) == 1 && v_pool.stride(2) == 1
                && k_pool.strides() == v_pool.strides(), "K and V pools must have one layout with D contiguous");
    q = q.contiguous();
    tables = tables.contiguous();
    lengths = lengths.contiguous();
    const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
    const int64_t slots = k_pool.size(0), kv_heads = k_pool.size(1), width = tables.size(1);
    TORCH_CHECK(k_pool.size(2) == dim && kv_heads > 0 && heads % kv_heads == 0, "head counts or head dim mismatch");
    TORCH_CHECK(tables.size(0) == batch && lengths.size(0) == batch && block_size > 0, "batch or block size mismatch");
    TORCH_CHECK(split_keys > 0 && split_keys % kTile == 0, "split_keys must be a positive multiple of ", kTile);
    const int32_t* table = tables.data_ptr<int32_t>();
    const int32_t* length = lengths.data_ptr<int32_t>();
    // Checked before any read: a wrong plan is an error here, never a read out of the pool.
    for (int64_t b = 0; b < batch; ++b) {
        TORCH_CHECK(length[b] >= 1 && length[b] <= width * block_size, "context length out of range for its table");
        for (int64_t i = 0; i < (length[b] + block_size - 1) / block_size; ++i) {
            const int64_t block = table[b * width + i];
            TORCH_CHECK(block >= 0 && (block + 1) * block_size <= slots, "block id outside the pool");
        }
    }
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = k_pool.stride(0), head_stride = k_pool.stride(1);
    const float* qs = q.data_ptr<float>();
    auto out = torch::empty({batch, heads, dim}, q.options());
    float* os = out.data_ptr<float>();
    const float softmax_scale = static_cast<float>(scale);

    // Row tiles: runs of up to kTileRows consecutive rows of one sequence (the same table,
    // lengths one apart: the queries of a prefill chunk), which share every key and value
    // tile they read. A decode is a tile of one row.
    std::vector<std::pair<int64_t, int64_t>> tiles;  // [first row, end row)
    for (int64_t b = 0; b < batch;) {
        int64_t end = b + 1;
        while (end < batch && end - b < kTileRows && length[end] == length[end - 1] + 1
               && std::equal(table + end * width, table + (end + 1) * width, table + b * width))
            ++end;
        tiles.emplace_back(b, end);
        b = end;
    }
    // Work items: (row tile, split of its keys); a tile whose longest row has at most split_keys
    // keys is one item. ``first_query``: each split item's rows' place in the partial buffers.
    struct Work { int64_t tile, key_begin, key_end, first_query; };
    std::vector<Work> work;
    int64_t split_queries = 0;
    for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
        const int64_t longest = length[tiles[t].second - 1];
        if (longest <= split_keys) {
            work.push_back({t, 0, longest, -1});
            continue;
        }
        for (int64_t k0 = 0; k0 < longest; k0 += split_keys) {
            work.push_back({t, k0, std::min(longest, k0 + split_keys), split_queries});
            split_queries += (tiles[t].second - tiles[t].first) * heads;
        }
    }
    // Per split item, head and query row: its unnormalized output, softmax maximum and sum
    // (each unit writes its own; left uninitialized: zeroing ~1 MB for a long chunk showed).
    std::unique_ptr<float[]> partial(new float[split_queries * dim]);
    std::vector<float> peaks(split_queries), sums(split_queries);
    const int64_t units = static_cast<int64_t>(work.size()) * kv_heads;

    // One unit per (work item, KV head), so that two threads share even a batch of one
    // sequence. A unit lists where each of its keys lies once (walking the block table), then
    // each query head of the group, for each row of the tile, scores the keys and weighs the
    // values. ``ks`` / ``vs``: the pools as stored (float, at::Half or at::BFloat16), widened
    // as they are read. Units go to whichever thread is free next (a shared counter), not in equal counts:
    // units differ in size (a split's last piece may hold a few keys; a batch mixes
    // contexts), and equal counts left one thread with 5 of a long chunk's 8 tiles (0.85x
    // unsplit at 128 rows x 2,000 keys). Which thread runs a unit does not change its bits.
    std::atomic<int64_t> next_unit{0};
    auto attend = [&](const auto* ks, const auto* vs) {
    at::parallel_for(0, std::min<int64_t>(units, at::get_num_threads()), 1, [&](int64_t, int64_t) {
        std::vector<float> scores, total, peak;
        std::vector<int64_t> rows;
        for (int64_t unit; (unit = next_unit.fetch_add(1)) < units;) {
            const Work& item = work[unit / kv_heads];
            const int64_t b0 = tiles[item.tile].first, b1 = tiles[item.tile].second;
            const int64_t h = unit % kv_heads, tile_rows = b1 - b0;
            const int64_t k0 = item.key_begin, span = item.key_end - k0;  // keys [k0, k0 + span)
            const bool split = item.first_query >= 0;
            const int32_t* blocks = table + b0 * width;
            rows.resize(span);  // rows[j]: key k0 + j
            for (int64_t j = 0, i = k0 / block_size, offset = k0 % block_size; j < span; ++i, offset = 0) {
                const int64_t start = static_cast<int64_t>(blocks[i]) * block_size;
                for (; offset < block_size && j < span; ++offset, ++j)
                    rows[j] = (start + offset) * slot_stride + h * head_stride;
            }
            // Query row (r, g): row b0 + r's head h * group + g, its scores at (r * group + g) * span.
            const int64_t queries = tile_rows * group;
            auto query = [&](int64_t r, int64_t g) { return qs + ((b0 + r) * heads + h * group + g) * dim; };
            auto slot = [&](int64_t r, int64_t g) { return item.first_query + r * heads + h * group + g; };
            auto output = [&](int64_t r, int64_t g) {
                return split ? partial.get() + slot(r, g) * dim : os + ((b0 + r) * heads + h * group + g) * dim;
            };
            // Keys of row r in this item: [k0, min(its length, k0 + span)).
            auto keys_of = [&](int64_t r) { return std::min<int64_t>(length[b0 + r] - k0, span); };
            scores.resize(queries * span);
            total.resize(queries);
            peak.resize(queries);
            // Tiles of keys and values small enough to stay in L1 while every query row of the
            // unit uses them: the K and V rows come from memory once per unit. A row stops at
            // its own length; tiles start at multiples of kTile whatever the tile of rows, so
            // each row runs exactly the operations it would alone (bit-identical results).
            // Asked into L2 ahead of use (prefetch_rows): the first key tile now, then the two
            // tiles after the current one, and the first two value tiles while the last keys
            // are scored. With one tile ahead and neither start covered, a unit waited on
            // memory at its start and at the turn from keys to values (from memory, 96
            // layers' tables over a 150 MB pool: 1.08-1.17x at 1 x 900 to 16 x 300 tokens,
            // one thread or two). Each tile is asked for twice on purpose: asking only for
            // the one two ahead ran at 0.6x (a tile is 128 lines; prefetches past what the
            // core keeps in flight are dropped, and nothing asked again). The cost: 0.9x
            // when the whole pool sits in cache (short contexts, few sequences).
            prefetch_rows(ks, rows.data(), 0, std::min(span, kTile), dim);
            for (int64_t t = 0; t < span; t += kTile) {
                prefetch_rows(ks, rows.data(), std::min(span, t + kTile), std::min(span, t + 3 * kTile), dim);
                if (t + 2 * kTile >= span) prefetch_rows(vs, rows.data(), 0, std::min(span, 2 * kTile), dim);
                for (int64_t r = 0; r < tile_rows; ++r) {
                    const int64_t n = std::min(kTile, keys_of(r) - t);
                    if (n <= 0) continue;
                    for (int64_t g = 0; g < group; ++g)
                        score(query(r, g), ks, rows.data() + t, n, dim, softmax_scale, scores.data() + (r * group + g) * span + t);
                }
            }
            for (int64_t r = 0; r < tile_rows; ++r)
                for (int64_t g = 0; g < group; ++g) {
                    if (keys_of(r) > 0)
                        total[r * group + g] = softmax_numerators(scores.data() + (r * group + g) * span, keys_of(r), &peak[r * group + g]);
                    std::fill(output(r, g), output(r, g) + dim, 0.f);
                }
            for (int64_t t = 0; t < span; t += kTile) {
                prefetch_rows(vs, rows.data(), std::min(span, t + kTile), std::min(span, t + 3 * kTile), dim);
                for (int64_t r = 0; r < tile_rows; ++r) {
                    const int64_t n = std::min(kTile, keys_of(r) - t);
                    if (n <= 0) continue;
                    for (int64_t g = 0; g < group; ++g)
                        weigh(scores.data() + (r * group + g) * span + t, vs, rows.data() + t, n, dim, output(r, g));
                }
            }
            for (int64_t r = 0; r < tile_rows; ++r)
                for (int64_t g = 0; g < group; ++g) {
                    if (split) {  // combined below, with the row's other splits
                        peaks[slot(r, g)] = keys_of(r) > 0 ? peak[r * group + g] : -std::numeric_limits<float>::infinity();
                        sums[slot(r, g)] = keys_of(r) > 0 ? total[r * group + g] : 0.f;
                        continue;
                    }
                    float* o = output(r, g);
                    for (int64_t d = 0; d < dim; ++d) o[d] /= total[r * group + g];
                }
        }
    });
    };
    with_pool_type(k_pool, v_pool, attend);

    // A split row's pieces, in key order: out = sum_s e_s o_s / sum_s e_s l_s with
    // e_s = exp(m_s - max_s m_s). Only the pieces holding any of the row's keys count. Rows
    // shared over the threads (a long chunk has ~100 of them).
    std::vector<std::pair<int64_t, int64_t>> split_rows;  // (first piece's work item, row in its tile)
    for (int64_t w = 0; w < static_cast<int64_t>(work.size()); ++w)
        if (work[w].first_query >= 0 && work[w].key_begin == 0)
            for (int64_t r = 0; r < tiles[work[w].tile].second - tiles[work[w].tile].first; ++r) split_rows.emplace_back(w, r);
    at::parallel_for(0, static_cast<int64_t>(split_rows.size()), 8, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
            const Work& item = work[split_rows[i].first];
            const int64_t r = split_rows[i].second, b0 = tiles[item.tile].first;
            const int64_t tile_queries = (tiles[item.tile].second - b0) * heads;
            const int64_t pieces = (length[b0 + r] + split_keys - 1) / split_keys;
            for (int64_t head = 0; head < heads; ++head) {
                const int64_t at = item.first_query + r * heads + head;  // piece s: at + s * tile_queries
                float top = peaks[at];
                for (int64_t s = 1; s < pieces; ++s) top = std::max(top, peaks[at + s * tile_queries]);
                float* o = os + ((b0 + r) * heads + head) * dim;
                std::fill(o, o + dim, 0.f);
                float denominator = 0.f;
                for (int64_t s = 0; s < pieces; ++s) {
                    const int64_t piece = at + s * tile_queries;
                    const float e = std::exp(peaks[piece] - top);
                    denominator += e * sums[piece];
                    const float* part = partial.get() + piece * dim;
                    for (int64_t d = 0; d < dim; ++d) o[d] += e * part[d];
                }
                for (int64_t d = 0; d < dim; ++d) o[d] /= denominator;
            }
        }
    });
    return out;
}

// Writes a step's new keys and values into one layer's pools: token t's K / V (key[h, t],
// value[h, t], [H_kv, T, D], any strides with D contiguous) to pool row slots[t]. What
// ``index_copy_`` of the transposed K and V does, in one call instead of six ops per layer.
void write_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots, torch::Tensor key, torch::Tensor value) {
    TORCH_CHECK(key.dtype() == torch::kFloat32 && value.dtype() == torch::kFloat32, "write_kv takes float32 keys and values");
    TORCH_CHECK(k_pool.dtype() == v_pool.dtype() && (k_pool.dtype() == torch::kFloat32 || k_pool.dtype() == torch::kFloat16
                || k_pool.dtype() == torch::kBFloat16), "write_kv writes float32, float16 or bfloat16 pools, K and V alike");
    TORCH_CHECK(slots.dtype() == torch::kInt64 && slots.dim() == 1, "slots must be int64 [T]");
    TORCH_CHECK(!k_pool.is_cuda() && !v_pool.is_cuda() && !key.is_cuda() && !value.is_cuda(), "write_kv runs on CPU tensors");
    TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && key.dim() == 3 && value.sizes() == key.sizes(),
                "expected pools [slots, H_kv, D] and key / value [H_kv, T, D]");
    const int64_t heads = key.size(0), tokens = key.size(1), dim = key.size(2), rows = k_pool.size(0);
    TORCH_CHECK(k_pool.size(1) == heads && k_pool.size(2) == dim && slots.size(0) == tokens, "write_kv shape mismatch");
    TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
                "the head dim must be contiguous");
    slots = slots.contiguous();
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < rows, "slot outside the pool");
    const float* ks = key.data_ptr<float>();
    const float* vs = value.data_ptr<float>();
    // Into a half-precision pool each value is rounded to nearest-even, as ``.to(dtype)`` does.
    auto write = [&](auto* kp, auto* vp) {
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t h = 0; h < heads; ++h) {
                std::copy_n(ks + h * key.stride(0) + t * key.stride(1), dim, kp + slot[t] * k_pool.stride(0) + h * k_pool.stride(1));
                std::copy_n(vs + h * value.stride(0) + t * value.stride(1), dim, vp + slot[t] * v_pool.stride(0) + h * v_pool.stride(1));
            }
    };
    with_pool_type(k_pool, v_pool, write);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("write_kv", &write_kv, "a step's new K / V into one layer's pools at their slots (CPU, float32)");
    m.def("paged_decode", &paged_decode, "decode attention reading K/V in place from a paged pool (CPU, float32)",
          py::call_guard<py::gil_scoped_release>());  // the server's event loop runs meanwhile
}
