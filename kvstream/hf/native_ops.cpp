// The decoder's small elementwise ops on CPU in one call each: RMSNorm and rotary position
// embedding (float32).
//
// Why: at decode sizes (a few rows of 576 floats) each op costs its dispatch, not its
// arithmetic. transformers' RMSNorm is seven torch ops (~30-45 us here) and its rotary
// embedding eleven (~50 us), twice and once per layer per step: ~3 ms of a 30 ms SmolLM2
// decode step. One call each costs a few microseconds.
//
// Rounding: built with -ffp-contract=off (native_ops.py), so that every product and sum is
// rounded on its own, as torch's separate ops round them. ``rotary`` then gives bit for bit
// what transformers' ``apply_rotary_pos_emb`` gives (tested); ``rms_norm`` sums the squares in
// another order than torch's ``mean`` and can differ from it in the last bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

// out = weight * (x * (1 / sqrt(mean(x^2) + eps))) for one row of n floats.
void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
    // Eight partial sums (vectorizable without reassociating anything), then combined.
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int lane = 0; lane < 8; ++lane) {
            const float square = x[i + lane] * x[i + lane];
            partial[lane] += square;
        }
    float total = 0.0f;
    for (int lane = 0; lane < 8; ++lane) total += partial[lane];
    for (; i < n; ++i) {
        const float square = x[i] * x[i];
        total += square;
    }
    const float variance = total / static_cast<float>(n);
    const float inverse = 1.0f / std::sqrt(variance + eps);
    for (int64_t j = 0; j < n; ++j) {
        const float normed = x[j] * inverse;
        out[j] = weight[j] * normed;
    }
}

}  // namespace

// RMSNorm over the last dimension of ``x`` (float32, any leading shape, rows of stride
// ``n``): weight * (x / sqrt(mean(x^2) + eps)), a new contiguous tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "x and weight must be float32");
    TORCH_CHECK(!x.is_cuda() && !weight.is_cuda(), "CPU tensors only");
    const int64_t n = weight.numel();
    TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == n, "weight must be [n] and x [..., n]");
    x = x.contiguous();
    weight = weight.contiguous();
    auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
    const int64_t rows = n == 0 ? 0 : x.numel() / n;
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float e = static_cast<float>(eps);
    // Rows are independent: split them for prefill chunks, one thread for a decode's few.
    at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)), [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) rms_norm_row(xp + r * n, wp, n, e, op + r * n);
    });
    return out;
}

// transformers' ``rotate_half`` rotary embedding, ``x * cos + rotate_half(x) * sin`` with
// rotate_half(x) = cat(-x[d/2:], x[:d/2]), for x [B, H, T, D] (any strides, last dimension
// contiguous) and cos / sin [B or 1, T, D] (broadcast over heads). The result has x's layout.
static torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3), half = dim / 2;
    auto out = torch::empty_like(x);  // same strides as x (a dense transposed view stays so)
    const float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), ct = cos.stride(1);
    const int64_t sb = sin.size(0) == 1 ? 0 : sin.stride(0), st = sin.stride(1);
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t t = 0; t < tokens; ++t) {
                const float* xr = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
                float* orow = op + b * out.stride(0) + h * out.stride(1) + t * out.stride(2);
                const float* c = cp + b * cb + t * ct;
                const float* s = sp + b * sb + t * st;
                for (int64_t d = 0; d < half; ++d) {
                    const float straight = xr[d] * c[d], rotated = xr[d + half] * s[d];
                    orow[d] = straight - rotated;
                }
                for (int64_t d = half; d < dim; ++d) {
                    const float straight = xr[d] * c[d], rotated = xr[d - half] * s[d];
                    orow[d] = straight + rotated;
                }
            }
    return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
    for (const auto& t : {q, k, cos, sin}) {
        TORCH_CHECK(t.dtype() == torch::kFloat32 && !t.is_cuda(), "float32 CPU tensors only");
        TORCH_CHECK(t.stride(-1) == 1, "the last dimension must be contiguous");
    }
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, "q, k [B, H, T, D]; cos, sin [B, T, D]");
    TORCH_CHECK(cos.sizes() == sin.sizes(), "cos and sin differ in shape");
    for (const auto& t : {q, k}) {
        TORCH_CHECK(t.size(2) == cos.size(1) && t.size(3) == cos.size(2) && t.size(3) % 2 == 0, "q / k do not match cos / sin");
        TORCH_CHECK(cos.size(0) == 1 || cos.size(0) == t.size(0), "cos / sin batch does not broadcast");
    }
    return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32, CPU)", py::arg("x"), py::arg("weight"), py::arg("eps"));
    m.def("rotary", &rotary, "rotate_half rotary embedding of q and k (float32, CPU)", py::arg("q"), py::arg("k"),
          py::arg("cos"), py::arg("sin"));
}
