// y = x @ W^T for a few rows of x (decode steps): float32 x on CPU, W in float32 or in half
// precision (float16 / bfloat16: a half-precision checkpoint's layers, an AWQ checkpoint's
// embeddings tied to the LM head), read as stored and widened to float32 in registers,
// exactly, so the products and sums are those of the upcast matrix.
//
// A decode step multiplies 1 to a few dozen token rows by every weight matrix of the model.
// BLAS's sgemm is built for large blocks: at 16 rows it reaches a third of this machine's
// matmul peak and a fifth of its memory bandwidth (50 GFLOP/s, 6 GB/s for SmolLM2's
// projections, weights coming from DRAM as they do in a forward). Here each group of three
// weight rows is read from memory once and multiplied by every row of x while it sits in L1:
// twelve 8-lane accumulators (4 rows of x by 3 rows of W) in registers, one horizontal sum
// per output at the end. The weight streams at close to memory bandwidth for one row of x
// and the FMA units stay busy for many.
//
// Each output y[m, n] is the dot product of x[m] and W[n] summed in one fixed order (8 lane
// partial sums over k, then a fixed reduction tree), whatever the other rows, the row count
// or the thread split: a row's result does not depend on what it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVSTREAM_AVX2 1
#endif

namespace {

constexpr int64_t kWeightRows = 3;  // rows of W per tile
constexpr int64_t kInputRows = 4;   // rows of x per tile

#ifdef KVSTREAM_AVX2
// Eight weights widened to float32 (exact for both half formats).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is float32's upper half
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// y[m, n] for MR rows of x (x, stride ldx) and NR rows of W (w, stride k); k % 8 == 0.
template <int MR, int NR, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy, const W* next) {
    constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t d = 0; d < k; d += 8) {
        // The next tile's lines, into L2 (T1), not L1 (T0): with T0 a one-row call read its
        // weights from memory at 16-23 GB/s, with T1 at 27-38 GB/s (two threads; 1.6-1.8x at
        // one row, 1.2-1.4x at four, 1.05-1.15x at sixteen; the LM head of SmolLM2 3.0 -> 1.7 ms).
        if (next != nullptr && d % kLine == 0)
            for (int n = 0; n < kWeightRows; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * k + d), _MM_HINT_T1);
        __m256 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = load8(w + n * k + d);
        for (int m = 0; m < MR; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + d);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) y[m * ldy + n] = hsum(acc[m][n]);
}

template <int NR, typename W>
void rows_of_w(const float* x, int64_t rows, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy, const W* next) {
    int64_t m = 0;
    for (; m + kInputRows <= rows; m += kInputRows, next = nullptr) tile<kInputRows, NR>(x + m * ldx, ldx, w, k, y + m * ldy, ldy, next);
    switch (rows - m) {
        case 3: tile<3, NR>(x + m * ldx, ldx, w, k, y + m * ldy, ldy, next); break;
        case 2: tile<2, NR>(x + m * ldx, ldx, w, k, y + m * ldy, ldy, next); break;
        case 1: tile<1, NR>(x + m * ldx, ldx, w, k, y + m * ldy, ldy, next); break;
        default: break;
    }
}
#endif

// The same sums without vectors: 8 partial sums over k (lane d % 8), added as hsum does.
template <typename W>
void scalar_dot_rows(const float* x, int64_t rows, int64_t ldx, const W* w, int64_t k, int64_t nr, float* y, int64_t ldy) {
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t n = 0; n < nr; ++n) {
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float* xr = x + m * ldx;
            const W* wr = w + n * k;
            for (int64_t d = 0; d < k; ++d) lane[d % 8] += xr[d] * static_cast<float>(wr[d]);
            const float a = lane[0] + lane[4], b = lane[1] + lane[5], c = lane[2] + lane[6], e = lane[3] + lane[7];
            y[m * ldy + n] = (a + c) + (b + e);
        }
}

template <typename W>
void linear_rows(const float* xp, int64_t rows, int64_t ldx, const W* wp, int64_t k, int64_t n_out, float* yp) {
    const int64_t tiles = (n_out + kWeightRows - 1) / kWeightRows;
    // Contiguous runs of weight rows per thread: each streams its own part of W once.
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n = t * kWeightRows, nr = std::min(kWeightRows, n_out - n);
            const W* w = wp + n * k;
            float* out = yp + n;
#ifdef KVSTREAM_AVX2
            if (k % 8 == 0) {
                const W* next = t + 1 < end ? w + kWeightRows * k : nullptr;
                if (nr == 3) rows_of_w<3>(xp, rows, ldx, w, k, out, n_out, next);
                else if (nr == 2) rows_of_w<2>(xp, rows, ldx, w, k, out, n_out, next);
                else rows_of_w<1>(xp, rows, ldx, w, k, out, n_out, next);
                continue;
            }
#endif
            scalar_dot_rows(xp, rows, ldx, w, k, nr, out, n_out);
        }
    });
}

}  // namespace

// x [M, K] float32 (rows dense), weight [N, K] contiguous float32 / float16 / bfloat16 ->
// [M, N] float32.
torch::Tensor native_linear(const torch::Tensor& x, const torch::Tensor& weight) {
    const auto kind = weight.scalar_type();
    TORCH_CHECK(x.dtype() == torch::kFloat32, "native_linear takes float32 inputs");
    TORCH_CHECK(kind == torch::kFloat32 || kind == torch::kHalf || kind == torch::kBFloat16,
                "native_linear takes float32, float16 or bfloat16 weights");
    TORCH_CHECK(!x.is_cuda() && !weight.is_cuda(), "native_linear runs on CPU tensors");
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K] expected");
    TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "weight must be contiguous and x's rows dense");
    const int64_t rows = x.size(0), k = x.size(1), n_out = weight.size(0), ldx = x.stride(0);
    auto y = torch::empty({rows, n_out}, x.options());
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    if (kind == torch::kHalf) linear_rows(xp, rows, ldx, weight.data_ptr<at::Half>(), k, n_out, yp);
    else if (kind == torch::kBFloat16) linear_rows(xp, rows, ldx, weight.data_ptr<at::BFloat16>(), k, n_out, yp);
    else linear_rows(xp, rows, ldx, weight.data_ptr<float>(), k, n_out, yp);
    return y;
}

// How many threads at::parallel_for spreads ``tasks`` tasks over. at::parallel_for is inline
// OpenMP: in an extension compiled without -fopenmp it silently runs everything on one
// thread, which is what native_build's flags are there to prevent (tested).
int64_t parallel_threads(int64_t tasks) {
    std::atomic<int64_t> threads{1};
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
        const int64_t mine = at::get_thread_num() + 1;
        int64_t seen = threads.load();
        while (mine > seen && !threads.compare_exchange_weak(seen, mine)) {}
    });
    return threads.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("native_linear", &native_linear, "x @ weight^T for a few rows of x (float32 x; float32, float16 or bfloat16 weight; CPU)",
          py::call_guard<py::gil_scoped_release>());  // the server's event loop runs meanwhile
    m.def("parallel_threads", &parallel_threads, "threads at::parallel_for runs on (1 when built without OpenMP)");
}
