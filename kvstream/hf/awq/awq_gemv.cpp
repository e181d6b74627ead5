// AWQ GEMM-layout int4 matmul for a few rows (decode): y = x @ W, W = (q - zero) * scale,
// read straight from the checkpoint's tensors, never dequantized into memory.
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
// Each output's sums run in a fixed order whatever the row count or thread split, so a row's
// result does not depend on what it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

torch::Tensor awq_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor qzeros, torch::Tensor scales,
                       torch::Tensor logical, int64_t group_size) {
    TORCH_CHECK(x.dtype() == torch::kFloat32, "x must be float32");
    TORCH_CHECK(qweight.dtype() == torch::kInt32 && qzeros.dtype() == torch::kInt32, "qweight and qzeros must be int32");
    TORCH_CHECK(scales.dtype() == torch::kFloat16, "scales must be float16");
    TORCH_CHECK(logical.dtype() == torch::kInt64, "logical must be int64");
    x = x.contiguous();
    qweight = qweight.contiguous();
    qzeros = qzeros.contiguous();
    scales = scales.contiguous();
    logical = logical.contiguous();
    const int64_t rows = x.size(0), in = qweight.size(0), words = qweight.size(1), out = words * 8;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in && group_size > 0 && in % group_size == 0, "shape mismatch");
    const int64_t groups = in / group_size;
    TORCH_CHECK(qzeros.size(0) == groups && qzeros.size(1) == words && scales.size(0) == groups && scales.size(1) == out
                && logical.numel() == out, "qzeros / scales / logical shape mismatch");
    auto y = torch::zeros({rows, out}, x.options());
    if (rows == 0) return y;
    auto xsum = x.view({rows, groups, group_size}).sum(-1).contiguous();  // [rows, groups]
    const float* xp = x.data_ptr<float>();
    const int32_t* qp = qweight.data_ptr<int32_t>();
    const int32_t* zp = qzeros.data_ptr<int32_t>();
    const at::Half* sp = scales.data_ptr<at::Half>();
    const int64_t* lp = logical.data_ptr<int64_t>();
    const float* xs = xsum.data_ptr<float>();
    float* yp = y.data_ptr<float>();

    // Columns in tiles whose accumulators (rows x tile) stay within L1.
    const int64_t tile = std::max<int64_t>(1, 512 / rows);
    at::parallel_for(0, words, 16, [&](int64_t first, int64_t last) {
      std::vector<float> acc(rows * std::min(tile, last - first) * 8);
      for (int64_t begin = first; begin < last; begin += tile) {
        const int64_t end = std::min(last, begin + tile);
        const int64_t width = (end - begin) * 8;
        for (int64_t g = 0; g < groups; ++g) {
            std::fill(acc.begin(), acc.begin() + rows * width, 0.0f);
            for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
                const int32_t* row = qp + i * words;
#if defined(__AVX2__) && defined(__FMA__)
                const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
                const __m256i low = _mm256_set1_epi32(0xF);
                for (int64_t j = begin; j < end; ++j) {
                    __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(row[j]), shifts), low);
                    __m256 q = _mm256_cvtepi32_ps(nibbles);
                    float* a = acc.data() + (j - begin) * 8;
                    for (int64_t m = 0; m < rows; ++m) {
                        __m256 xi = _mm256_set1_ps(xp[m * in + i]);
                        float* am = a + m * width;
                        _mm256_storeu_ps(am, _mm256_fmadd_ps(q, xi, _mm256_loadu_ps(am)));
                    }
                }
#else
                for (int64_t j = begin; j < end; ++j) {
                    const uint32_t word = static_cast<uint32_t>(row[j]);
                    for (int64_t m = 0; m < rows; ++m) {
                        const float xi = xp[m * in + i];
                        float* am = acc.data() + m * width + (j - begin) * 8;
                        for (int n = 0; n < 8; ++n) am[n] += xi * static_cast<float>((word >> (4 * n)) & 0xF);
                    }
                }
#endif
            }
            for (int64_t o = 0; o < width; ++o) {
                const int64_t packed = begin * 8 + o, column = lp[packed];
                const float scale = static_cast<float>(sp[g * out + column]);
                const float zero = static_cast<float>((static_cast<uint32_t>(zp[g * words + packed / 8]) >> (4 * (packed % 8))) & 0xF);
                for (int64_t m = 0; m < rows; ++m)
                    yp[m * out + column] += (acc[m * width + o] - zero * xs[m * groups + g]) * scale;
            }
        }
      }
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("awq_gemv", &awq_gemv, "AWQ int4 matmul for a few rows, from the checkpoint's tensors",
          py::call_guard<py::gil_scoped_release>());  // the server's event loop runs meanwhile
}
