// Out-of-place AdamW step with DeepSpeed CPU Adam's arithmetic, for optim.rollback=exact.
//
// Reads (p, m, v) from one set of buffers and writes the new values into another, so a rollback
// is a pointer switch. The per-element arithmetic is DeepSpeed's Adam_Optimizer::Step_AVX body
// (csrc/includes/cpu_adam.h: the same SIMD macros from its simd.h, in the same order) and, for
// the last n % SIMD_WIDTH elements, its scalar Step_1 tail (csrc/adam/cpu_adam_impl.cpp), written
// the same way and compiled with the same flags, so results are bit-identical to its in-place op.
//
// Why streaming stores: an out-of-place step writes 12 bytes per element into lines it never read,
// and a normal store first reads each such line (read-for-ownership): 40 bytes of traffic per
// element instead of the in-place step's 28. Non-temporal stores skip that read. They need
// SIMD-aligned addresses, so each destination streams only when its base is aligned (torch
// allocations are 64-byte aligned; sysx steps chunks whose offsets keep that alignment).
//
// Pointers arrive as integers (the Python side checks dtype, size and contiguity): the module then
// needs only pybind11 and c10's half types (for simd.h), which keeps the first build short.

#include <pybind11/pybind11.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "simd.h"  // DeepSpeed's csrc/includes/simd.h

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

struct Constants {
    float beta1, beta2, eps, weight_decay, bias_correction2, step_size, w_decay;
};

#if defined(__AVX512__) or defined(__AVX256__) or defined(__NEON__)
#if defined(__AVX512__)
#define EXACT_STREAM(a, d) _mm512_stream_ps(a, d)
#define EXACT_ALIGN 64
#define EXACT_FENCE() _mm_sfence()
#elif defined(__AVX256__)
#define EXACT_STREAM(a, d) _mm256_stream_ps(a, d)
#define EXACT_ALIGN 32
#define EXACT_FENCE() _mm_sfence()
#else  // NEON: no streaming store
#define EXACT_STREAM(a, d) SIMD_STORE(a, d)
#define EXACT_ALIGN 16
#define EXACT_FENCE() \
    do {              \
    } while (0)
#endif

constexpr int kSpan = 8;  // vectors per iteration, as DeepSpeed's Step_8

// Software prefetch distance in elements (0: none); see profiling/RESULTS.md for what was measured.
#ifndef EXACT_PREFETCH
#define EXACT_PREFETCH 0
#endif

inline void prefetch_block(std::size_t i, const float* ps, const float* g, const float* ms, const float* vs)
{
#if EXACT_PREFETCH > 0 && (defined(__AVX512__) || defined(__AVX256__))
    constexpr std::size_t lines = SIMD_WIDTH * kSpan * sizeof(float) / 64;
    for (std::size_t l = 0; l < lines; ++l) {
        const std::size_t j = i + EXACT_PREFETCH + 16 * l;
        _mm_prefetch(reinterpret_cast<const char*>(g + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ms + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vs + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ps + j), _MM_HINT_T0);
    }
#else
    (void)i, (void)ps, (void)g, (void)ms, (void)vs;
#endif
}

inline bool aligned(const float* x) { return (reinterpret_cast<std::uintptr_t>(x) % EXACT_ALIGN) == 0; }

template <bool STREAM>
inline void store1(float* dst, const AVX_Data& x)
{
    if constexpr (STREAM) { EXACT_STREAM(dst, x.data); } else { SIMD_STORE(dst, x.data); }
}

// DeepSpeed's Step_AVX body for `span` vectors at element i (AdamW mode, bias correction on).
template <int span, bool SP, bool SM, bool SV>
inline void vec_step(std::size_t i, const float* ps, const float* g, const float* ms, const float* vs, float* pd,
                     float* md, float* vd, const AVX_Data& betta1_4, const AVX_Data& betta2_4,
                     const AVX_Data& betta1_minus1_4, const AVX_Data& betta2_minus1_4, const AVX_Data& bias2_sqrt,
                     const AVX_Data& eps_4, const AVX_Data& step_size_4, const AVX_Data& weight_decay4, bool decay)
{
    AVX_Data grad_4[span], momentum_4[span], variance_4[span], param_4[span];
    for (int k = 0; k < span; ++k) {
        grad_4[k].data = SIMD_LOAD(g + i + SIMD_WIDTH * k);
        momentum_4[k].data = SIMD_LOAD(ms + i + SIMD_WIDTH * k);
        variance_4[k].data = SIMD_LOAD(vs + i + SIMD_WIDTH * k);
        param_4[k].data = SIMD_LOAD(ps + i + SIMD_WIDTH * k);
    }
    for (int k = 0; k < span; ++k) {
        momentum_4[k].data = SIMD_MUL(momentum_4[k].data, betta1_4.data);
        momentum_4[k].data = SIMD_FMA(grad_4[k].data, betta1_minus1_4.data, momentum_4[k].data);
        variance_4[k].data = SIMD_MUL(variance_4[k].data, betta2_4.data);
        grad_4[k].data = SIMD_MUL(grad_4[k].data, grad_4[k].data);
        variance_4[k].data = SIMD_FMA(grad_4[k].data, betta2_minus1_4.data, variance_4[k].data);
        grad_4[k].data = SIMD_SQRT(variance_4[k].data);
        grad_4[k].data = SIMD_FMA(grad_4[k].data, bias2_sqrt.data, eps_4.data);
        grad_4[k].data = SIMD_DIV(momentum_4[k].data, grad_4[k].data);
        if (decay) { param_4[k].data = SIMD_FMA(param_4[k].data, weight_decay4.data, param_4[k].data); }
        param_4[k].data = SIMD_FMA(grad_4[k].data, step_size_4.data, param_4[k].data);
    }
    // stored as DeepSpeed stores them: the span's p lines, then its m lines, then its v lines (each
    // destination written in runs of `span` consecutive lines)
    for (int k = 0; k < span; ++k) { store1<SP>(pd + i + SIMD_WIDTH * k, param_4[k]); }
    for (int k = 0; k < span; ++k) { store1<SM>(md + i + SIMD_WIDTH * k, momentum_4[k]); }
    for (int k = 0; k < span; ++k) { store1<SV>(vd + i + SIMD_WIDTH * k, variance_4[k]); }
}

template <bool SP, bool SM, bool SV>
void simd_body(std::size_t n_vec_elems, const float* ps, const float* g, const float* ms, const float* vs, float* pd,
               float* md, float* vd, const Constants& c, bool parallel)
{
    AVX_Data betta1_4, betta2_4, betta1_minus1_4, betta2_minus1_4, bias2_sqrt, eps_4, step_size_4, weight_decay4;
    betta1_4.data = SIMD_SET(c.beta1);
    betta2_4.data = SIMD_SET(c.beta2);
    float betta1_minus1 = 1 - c.beta1;
    float betta2_minus1 = 1 - c.beta2;
    betta1_minus1_4.data = SIMD_SET(betta1_minus1);
    betta2_minus1_4.data = SIMD_SET(betta2_minus1);
    bias2_sqrt.data = SIMD_SET(c.bias_correction2);
    eps_4.data = SIMD_SET(c.eps);
    step_size_4.data = SIMD_SET(c.step_size);
    weight_decay4.data = SIMD_SET(c.w_decay);
    const bool decay = c.weight_decay > 0;
    constexpr std::size_t block = SIMD_WIDTH * kSpan;
    const std::size_t n_block = (n_vec_elems / block) * block;
    auto body = [&](std::size_t i) {
        prefetch_block(i, ps, g, ms, vs);  // prefetching past the end is harmless (a hint, never a fault)
        vec_step<kSpan, SP, SM, SV>(i, ps, g, ms, vs, pd, md, vd, betta1_4, betta2_4, betta1_minus1_4,
                                    betta2_minus1_4, bias2_sqrt, eps_4, step_size_4, weight_decay4, decay);
    };
    // the body's blocks split over OpenMP threads (torch.set_num_threads sets their number), as
    // DeepSpeed's; one thread runs a plain loop: no parallel region, no outlined function (measured
    // a few percent faster than `omp parallel for if (false)`, profiling/RESULTS.md)
    if (parallel) {
#if !defined(EXACT_NO_OMP)
#pragma omp parallel for
#endif
        for (std::size_t i = 0; i < n_block; i += block) { body(i); }
    } else {
        for (std::size_t i = 0; i < n_block; i += block) { body(i); }
    }
    for (std::size_t i = n_block; i < n_vec_elems; i += SIMD_WIDTH) {
        vec_step<1, SP, SM, SV>(i, ps, g, ms, vs, pd, md, vd, betta1_4, betta2_4, betta1_minus1_4, betta2_minus1_4,
                                bias2_sqrt, eps_4, step_size_4, weight_decay4, decay);
    }
}
#endif

// DeepSpeed's scalar Step_1 tail (AdamW mode), statement for statement.
void scalar_tail(std::size_t lo, std::size_t hi, const float* ps, const float* grads, const float* ms,
                 const float* vs, float* pd, float* md, float* vd, const Constants& c)
{
    float betta1_minus1 = 1 - c.beta1;
    float betta2_minus1 = 1 - c.beta2;
    float step_size = c.step_size;
    float w_decay = c.w_decay;
    for (std::size_t k = lo; k < hi; k++) {
        float grad = (float)grads[k];
        float param = (float)ps[k];
        float momentum = ms[k];
        float variance = vs[k];
        momentum = momentum * c.beta1;
        momentum = grad * betta1_minus1 + momentum;

        variance = variance * c.beta2;
        grad = grad * grad;
        variance = grad * betta2_minus1 + variance;

        grad = sqrt(variance);
        grad = grad * c.bias_correction2 + c.eps;
        grad = momentum / grad;
        if (c.weight_decay > 0) { param += w_decay * param; }
        param = grad * step_size + param;
        pd[k] = param;
        md[k] = momentum;
        vd[k] = variance;
    }
}

void step(std::uintptr_t p_src, std::uintptr_t m_src, std::uintptr_t v_src, std::uintptr_t grad,
          std::uintptr_t p_dst, std::uintptr_t m_dst, std::uintptr_t v_dst, std::size_t n, float beta1, float beta2,
          float eps, float weight_decay, float bias_correction2, float step_size, float w_decay, bool stream)
{
    const float* ps = reinterpret_cast<const float*>(p_src);
    const float* ms = reinterpret_cast<const float*>(m_src);
    const float* vs = reinterpret_cast<const float*>(v_src);
    const float* g = reinterpret_cast<const float*>(grad);
    float* pd = reinterpret_cast<float*>(p_dst);
    float* md = reinterpret_cast<float*>(m_dst);
    float* vd = reinterpret_cast<float*>(v_dst);
    const Constants c{beta1, beta2, eps, weight_decay, bias_correction2, step_size, w_decay};
    std::size_t rounded = 0;
    bool streamed = false;
#if defined(__AVX512__) or defined(__AVX256__) or defined(__NEON__)
    rounded = ROUND_DOWN(n, SIMD_WIDTH);
#if defined(_OPENMP)
    const bool parallel = omp_get_max_threads() > 1;
#else
    const bool parallel = false;
#endif
    const bool sp = stream && aligned(pd), sm = stream && aligned(md), sv = stream && aligned(vd);
    streamed = sp || sm || sv;
    // the common case (every destination aligned) and the all-normal one are instantiated; a mix
    // (a caller's unaligned view) takes normal stores: same results, only slower
    if (sp && sm && sv) {
        simd_body<true, true, true>(rounded, ps, g, ms, vs, pd, md, vd, c, parallel);
    } else {
        streamed = false;
        simd_body<false, false, false>(rounded, ps, g, ms, vs, pd, md, vd, c, parallel);
    }
#endif
    scalar_tail(rounded, n, ps, g, ms, vs, pd, md, vd, c);
#if defined(__AVX512__) or defined(__AVX256__) or defined(__NEON__)
    if (streamed) { EXACT_FENCE(); }  // streaming stores are weakly ordered: publish them before returning
#endif
}

const char* simd_name()
{
#if defined(__AVX512__)
    return "AVX512";
#elif defined(__AVX256__)
    return "AVX256";
#elif defined(__NEON__)
    return "NEON";
#else
    return "SCALAR";
#endif
}

int simd_width()
{
#if defined(__AVX512__) or defined(__AVX256__) or defined(__NEON__)
    return SIMD_WIDTH;
#else
    return 1;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod)
{
    mod.doc() = "sysx: out-of-place AdamW step with DeepSpeed CPU Adam's arithmetic (optim.rollback=exact)";
    mod.def(
        "step",
        [](std::uintptr_t p_src, std::uintptr_t m_src, std::uintptr_t v_src, std::uintptr_t grad,
           std::uintptr_t p_dst, std::uintptr_t m_dst, std::uintptr_t v_dst, std::size_t n, float beta1, float beta2,
           float eps, float weight_decay, float bias_correction2, float step_size, float w_decay, bool stream) {
            pybind11::gil_scoped_release nogil;  // other optimizer workers run Python meanwhile
            step(p_src, m_src, v_src, grad, p_dst, m_dst, v_dst, n, beta1, beta2, eps, weight_decay,
                 bias_correction2, step_size, w_decay, stream);
        },
        "new (p, m, v) at the *_dst pointers from the old ones at *_src and the gradients (n fp32 elements)");
    mod.def("simd", &simd_name, "the SIMD path compiled in");
    mod.def("simd_width", &simd_width, "fp32 lanes per vector");
}
