// CPU emulation harness for the CUDA kernels (see scripts/gpu-emu.sh), compiled together with the
// kernel sources themselves (kernels.h): runs version 1 (fused
// state pass + ssd_compute_out) and version 2 (ssd_chunk_state_local + ssd_state_passing,
// ssd_chunk_cb + ssd_compute_out_cb) of the SSD forward on one random problem and compares them.
// Arguments: batch seqlen nheads headdim ngroups dstate chunk opts seed [packed]
// (opts bits: 1 seq_idx, 2 initial states, 4 z, 8 D per channel, 16 dt_bias + softplus, 32 slow
// decay).
// With `packed` (batch 1): the row is split into random sequences (zero-length ones included),
// seq_idx is the one the split implies, bit 2 gives each sequence an initial state (some masked
// off), and the packed path (stage 2 with chunk_init, ssd_seq_init_out, ssd_states_at) is also
// run, in both versions of stage 2, and compared with a float64 recurrence sequence by sequence.
// Built with -DSSD_EMU_SM90, the kernels take their sm_90a paths (the walking stage 2's
// warpgroup products) and the Hopper output kernel runs too (emu.h emulates TMA, mbarriers and
// wgmma).
#include "kernels.h"
#include <random>
#include <string>
#include <functional>
thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;
thread_local BlockCtx* g_blk;
thread_local std::vector<std::vector<Copy>> g_groups;
thread_local std::vector<Copy> g_cur;

template <class F>
void launch(dim3e grid, int nt, size_t dyn_bytes, F f) {
    std::vector<float> dyn(dyn_bytes / 4 + 16, NAN);
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        std::fill(dyn.begin(), dyn.end(), NAN);
        BlockCtx ctx; std::barrier<> bar(nt); ctx.bar = &bar;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < (nt + 31) / 32; ++w) { wb.emplace_back(new std::barrier<>(32)); ctx.wbar[w] = wb.back().get(); }
        for (int g = 0; g < nt / 128; ++g) { wb.emplace_back(new std::barrier<>(128)); ctx.gbar[g] = wb.back().get(); }
        ctx.dyn = dyn.data();
        std::vector<std::thread> th;
        for (int t = 0; t < nt; ++t) th.emplace_back([&, t] {
            threadIdx = {(unsigned)t, 0, 0}; blockIdx = {x, y, z}; blockDim = {(unsigned)nt, 1, 1}; gridDim = grid; g_blk = &ctx;
            g_groups.clear(); g_cur.clear();
            f();
            bool pend = !g_cur.empty(); for (auto& gg : g_groups) pend |= !gg.empty(); if (pend) { fprintf(stderr, "pending cp.async at exit\n"); }
        });
        for (auto& t : th) t.join();
    }
}

// The packed path on one row split at cu, against a float64 recurrence sequence by sequence (the
// processed dt' of stage 1, dto, as its input). Returns the number of failed comparisons.
template <class Cmp>
size_t packed_path(const std::vector<int>& cu, const std::vector<int>& seq, const std::vector<float>& x,
                   const std::vector<float>& Bm, const std::vector<float>& Cm, const std::vector<float>& z,
                   const std::vector<float>& Dv, const float* zp, const std::vector<float>& dto,
                   const std::vector<float>& dac, const std::vector<float>& A, int L, int H, int P, int G, int N,
                   int Q, int nc, int opts, std::mt19937& rng, Cmp cmp) {
    const int nseq = (int)cu.size() - 1;
    const size_t st = (size_t)H * P * N;
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> sinit(nseq * st);
    for (auto& e : sinit) e = U(rng);
    std::vector<int> has(nseq, 0);
    for (int k = 0; k < nseq; ++k) has[k] = (opts & 2) && rng() % 5 != 0;
    // The host's tables (gpu/src/serving.rs: tables), serving convention.
    std::vector<int> chunk_init(2 * nc, 0), ranges, targets, ptargets;
    for (int c = 0; c < nc; ++c) {
        const int last = std::min((c + 1) * Q, L) - 1, k = seq[last];
        chunk_init[2 * c] = cu[k] >= c * Q && has[k] ? k : -1;
        chunk_init[2 * c + 1] = cu[k] >= c * Q && has[k] ? cu[k] - c * Q : 0;
    }
    for (int k = 0; k < nseq; ++k) {
        const int s = cu[k], e = cu[k + 1];
        if (e > s && has[k]) ranges.insert(ranges.end(), {s, std::min(e, (s / Q + 1) * Q), k, 0});
        targets.insert(targets.end(), {e > s ? e - 1 : -1, s, has[k] ? k : -1, 0});
    }
    std::vector<int> pos;
    for (int i = 0; i < 5; ++i) pos.push_back(rng() % L);
    for (int t : pos) ptargets.insert(ptargets.end(), {t, cu[seq[t]], has[seq[t]] ? seq[t] : -1, 0});
    const int ptiles = (P + 63) / 64, ntiles = (N + 63) / 64;
    const size_t nst = (size_t)nc * st, nx = (size_t)L * H * P;
    // Stage 2, version 2 (2a, then the pass with the tables) and version 1.
    std::vector<float> cst2(nst, NAN), fin2(st, NAN), cst1(nst, NAN), fin1(st, NAN);
    const int vec4 = (P * N) % 4 == 0 ? 1 : 0;
    launch({(unsigned)(nc * ptiles * ntiles * H), 1, 1}, 128, ssd_chunk_state_local_layout.smem[0], [&] {
        ssd_chunk_state_local({x.data(), Bm.data(), dto.data(), dac.data(), seq.data(), cst2.data(), L, H, P, G, N, Q, nc}); });
    launch({(unsigned)((P * N + (vec4 ? 1023 : 255)) / (vec4 ? 1024 : 256)), (unsigned)H, 1}, 256, 0, [&] {
        ssd_state_passing({dac.data(), nullptr, seq.data(), cst2.data(), fin2.data(), L, H, P, N, Q, nc, vec4, 0, sinit.data(), chunk_init.data()}); });
    launch({(unsigned)(ptiles * ntiles), (unsigned)H, 1}, 128, 0, [&] {
        ssd_fwd_pass_state({x.data(), Bm.data(), dto.data(), dac.data(), nullptr, seq.data(), cst1.data(), fin1.data(), L, H, P, G, N, Q, nc, sinit.data(), chunk_init.data()}); });
    // Stage 3 (version 1's kernel), then the initial states' share of out.
    std::vector<float> out(nx, NAN);
    const int itiles = (Q + 63) / 64;
    launch({(unsigned)(nc * itiles), (unsigned)(H * ptiles), 1}, 128, ssd_compute_out_layout.smem[ntiles - 1], [&] {
        ssd_compute_out({x.data(), Bm.data(), Cm.data(), Dv.data(), zp, dto.data(), dac.data(), cst2.data(), seq.data(), out.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, 0}); });
    const int nranges = (int)ranges.size() / 4;
    if (nranges > 0)
        launch({(unsigned)nranges, (unsigned)H, (unsigned)ptiles}, 128, 0, [&] {
            ssd_seq_init_out({Cm.data(), zp, dac.data(), sinit.data(), ranges.data(), out.data(), L, H, P, G, N, Q, nc, nranges}); });
    std::vector<float> var(nseq * st, NAN), pst(pos.size() * st, NAN);
    launch({(unsigned)nseq, (unsigned)H, (unsigned)(ptiles * ntiles)}, 128, 0, [&] {
        ssd_states_at({x.data(), Bm.data(), dto.data(), dac.data(), cst2.data(), sinit.data(), targets.data(), var.data(), L, H, P, G, N, Q, nc, nseq}); });
    launch({(unsigned)pos.size(), (unsigned)H, (unsigned)(ptiles * ntiles)}, 128, 0, [&] {
        ssd_states_at({x.data(), Bm.data(), dto.data(), dac.data(), cst2.data(), sinit.data(), ptargets.data(), pst.data(), L, H, P, G, N, Q, nc, (int)pos.size()}); });
    // The float64 recurrence.
    std::vector<float> outR(nx), varR(nseq * st), pstR(pos.size() * st), finR(st);
    std::vector<double> s(st);
    for (int k = 0; k < nseq; ++k) {
        for (size_t i = 0; i < st; ++i) s[i] = has[k] ? sinit[k * st + i] : 0.0;
        for (int t = cu[k]; t < cu[k + 1]; ++t) {
            const int c = t / Q, l = t % Q, g0 = 0;
            (void)g0;
            for (int h = 0; h < H; ++h) {
                const int g = h / (H / G);
                const double d = dto[((size_t)h * nc + c) * Q + l], decay = std::exp(d * (double)A[h]);
                for (int p = 0; p < P; ++p) {
                    double y = 0;
                    const double xv = x[((size_t)t * H + h) * P + p];
                    for (int n = 0; n < N; ++n) {
                        double& e = s[((size_t)h * P + p) * N + n];
                        e = decay * e + d * xv * Bm[((size_t)t * G + g) * N + n];
                        y += e * Cm[((size_t)t * G + g) * N + n];
                    }
                    y += (double)Dv[(opts & 8) ? h * P + p : h] * xv;
                    if (zp) { const double zz = z[((size_t)t * H + h) * P + p]; y = y * zz / (1 + std::exp(-zz)); }
                    outR[((size_t)t * H + h) * P + p] = (float)y;
                }
            }
            for (size_t j = 0; j < pos.size(); ++j)
                if (pos[j] == t) for (size_t i = 0; i < st; ++i) pstR[j * st + i] = (float)s[i];
        }
        for (size_t i = 0; i < st; ++i) varR[k * st + i] = (float)s[i];
        if (cu[k + 1] == L && cu[k + 1] > cu[k]) for (size_t i = 0; i < st; ++i) finR[i] = (float)s[i];
    }
    printf("packed: %d sequences (%d with an initial state, %d ranges), %zu positions\n", nseq,
           (int)std::count(has.begin(), has.end(), 1), nranges, pos.size());
    size_t bad = 0;
    bad += cmp("packed out vs f64", out, outR, 5e-3);
    bad += cmp("packed varlen_states vs f64", var, varR, 5e-3);
    bad += cmp("packed position_states vs f64", pst, pstR, 5e-3);
    bad += cmp("packed final_states vs f64", fin2, finR, 5e-3);
    bad += cmp("packed chunk_states v2 vs v1", cst2, cst1, 5e-3);
    bad += cmp("packed final_states v2 vs v1", fin2, fin1, 5e-3);
    return bad;
}

int main(int argc, char** argv) {
    int B = atoi(argv[1]), L = atoi(argv[2]), H = atoi(argv[3]), P = atoi(argv[4]), G = atoi(argv[5]), N = atoi(argv[6]), Q = atoi(argv[7]);
    int opts = atoi(argv[8]);  // bit0 seq_idx, bit1 init, bit2 z, bit3 D per channel, bit4 dt_bias+softplus, bit5 slow decay
    std::mt19937 rng(atoi(argv[9]));
    // bit 5: A 100 times smaller, so that a state outlives its chunk (exp(cs[last]) about 0.5
    // to 0.99 at 128 tokens instead of about 1e-6): the decay between chunks is then visible.
    std::uniform_real_distribution<float> U(-1, 1), Udt(0.001f, 0.1f), UA(-4, -0.5f), UAslow(-0.04f, -0.005f);
    auto vec = [&](size_t n, std::uniform_real_distribution<float>& d) { std::vector<float> v(n); for (auto& e : v) e = d(rng); return v; };
    int nc = (L + Q - 1) / Q;
    auto x = vec((size_t)B * L * H * P, U), dt = vec((size_t)B * L * H, Udt), A = vec(H, (opts & 32) ? UAslow : UA);
    auto Bm = vec((size_t)B * L * G * N, U), Cm = vec((size_t)B * L * G * N, U);
    auto z = vec((size_t)B * L * H * P, U);
    auto Dv = vec((opts & 8) ? H * P : H, U);
    auto init = vec((size_t)B * H * P * N, U);
    auto bias = vec(H, U);
    std::vector<int> seq(B * L);
    for (int b = 0; b < B; ++b) { int s = (b % 2) ? 1 : 0; for (int t = 0; t < L; ++t) { if (t > 0 && rng() % 37 == 0) s += 1 + rng() % 2; if (t > 0 && t % Q == 0 && rng() % 3 == 0) s++; seq[b * L + t] = s; } }
    const bool packed = argc > 10 && std::string(argv[10]) == "packed";
    std::vector<int> cu{0};  // packed: sequence k holds tokens [cu[k], cu[k + 1])
    if (packed) {
        if (B != 1) { fprintf(stderr, "packed needs batch 1\n"); return 2; }
        while (cu.back() < L) {
            int r = rng() % 4;
            int len = r == 0 ? 0 : r == 1 ? 1 + rng() % Q : r == 2 ? Q : 1 + rng() % (2 * Q + 3);
            cu.push_back(std::min(L, cu.back() + len));
        }
        for (size_t k = 0; k + 1 < cu.size(); ++k) for (int t = cu[k]; t < cu[k + 1]; ++t) seq[t] = (int)k;
    }
    const int* seqp = (opts & 1) || packed ? seq.data() : nullptr;
    const float* initp = (opts & 2) && !packed ? init.data() : nullptr;
    const float* zp = (opts & 4) ? z.data() : nullptr;
    const float* biasp = (opts & 16) ? bias.data() : nullptr;
    int softplus = (opts & 16) ? 1 : 0;
    size_t ncs = (size_t)B * H * nc * Q;
    std::vector<float> dto(ncs, NAN), dac(ncs, NAN);
    if (Q <= 256)  // the tiled kernel up to chunk 256 (the host also caps its grid at 1,024 blocks)
        launch({(unsigned)nc, (unsigned)((H + 31) / 32), (unsigned)B}, 256, 0, [&] {
            ssd_chunk_cumsum_tiled({dt.data(), A.data(), biasp, dto.data(), dac.data(), B, L, H, Q, nc, softplus, 0.0f, INFINITY, 0}); });
    else
        launch({(unsigned)((B * nc * H + 127) / 128), 1, 1}, 128, 0, [&] {
            ssd_chunk_cumsum({dt.data(), A.data(), biasp, dto.data(), dac.data(), B, L, H, Q, nc, softplus, 0.0f, INFINITY, 1}); });
    // old cumsum loop
    int bad = 0;
    for (int b = 0; b < B; ++b) for (int c = 0; c < nc; ++c) for (int h = 0; h < H; ++h) {
        float cs = 0; long long t0 = (long long)c * Q; long long valid = std::min<long long>(Q, L - t0);
        size_t o = (((size_t)b * H + h) * nc + c) * Q;
        for (int l = 0; l < Q; ++l) { float v = 0; if (l < valid) { v = dt[((size_t)b * L + t0 + l) * H + h]; if (biasp) v += bias[h]; if (softplus) v = v > 20 ? v : log1pf(expf(v)); v = fminf(fmaxf(v, 0.0f), INFINITY); }
            cs = cs + v * A[h]; if (memcmp(&dto[o + l], &v, 4) || memcmp(&dac[o + l], &cs, 4)) bad++; } }
    printf("cumsum mismatches vs old loop: %d\n", bad);
    size_t nst = (size_t)B * nc * H * P * N, nfs = (size_t)B * H * P * N, nx = (size_t)B * L * H * P;
    int ptiles = (P + 63) / 64, ntiles = (N + 63) / 64, itiles = (Q + 63) / 64;
    // legacy
    std::vector<float> cstL(nst, NAN), finL(nfs, NAN), outL(nx, NAN);
    launch({(unsigned)(ptiles * ntiles), (unsigned)H, (unsigned)B}, 128, 0, [&] {
        ssd_fwd_pass_state({x.data(), Bm.data(), dto.data(), dac.data(), initp, seqp, cstL.data(), finL.data(), L, H, P, G, N, Q, nc}); });
    size_t smem_old = ssd_compute_out_layout.smem[ntiles - 1];
    auto run_old_out = [&](std::vector<float>& cst, std::vector<float>& out) {
        launch({(unsigned)(nc * itiles), (unsigned)(H * ptiles), (unsigned)B}, 128, smem_old, [&] {
            ssd_compute_out({x.data(), Bm.data(), Cm.data(), Dv.data(), zp, dto.data(), dac.data(), cst.data(), seqp, out.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0}); });
    };
    run_old_out(cstL, outL);
    // new
    std::vector<float> cstN(nst, NAN), finN(nfs, NAN), outN(nx, NAN), outLN(nx, NAN);
    if (N > 64)  // the wide variant, as the host picks it: 128 dstate columns, 256 threads
        launch({(unsigned)(nc * ptiles * ((N + 127) / 128) * H), 1, (unsigned)B}, 256, ssd_chunk_state_local_wide_layout.smem[0], [&] {
            ssd_chunk_state_local_wide({x.data(), Bm.data(), dto.data(), dac.data(), seqp, cstN.data(), L, H, P, G, N, Q, nc}); });
    else
        launch({(unsigned)(nc * ptiles * ntiles * H), 1, (unsigned)B}, 128, ssd_chunk_state_local_layout.smem[0], [&] {
            ssd_chunk_state_local({x.data(), Bm.data(), dto.data(), dac.data(), seqp, cstN.data(), L, H, P, G, N, Q, nc}); });
    const int vec4 = (P * N) % 4 == 0 ? 1 : 0;
    launch({(unsigned)((P * N + (vec4 ? 1023 : 255)) / (vec4 ? 1024 : 256)), (unsigned)H, (unsigned)B}, 256, 0, [&] {
        ssd_state_passing({dac.data(), initp, seqp, cstN.data(), finN.data(), L, H, P, N, Q, nc, vec4}); });
    // 2a over pairs of units, where the host would launch it, then the same pass
    const int units_per_group2 = H / G * ptiles;
    const bool state_pairs = N > 64 && P % 4 == 0 && N % 4 == 0 && units_per_group2 % 2 == 0;
    std::vector<float> cstP(nst, NAN), finP(nfs, NAN);
    if (state_pairs) {
        launch({(unsigned)(nc * ((N + 127) / 128) * (H * ptiles / 2)), 1, (unsigned)B}, 256, ssd_chunk_state_local_pair_layout.smem[0], [&] {
            ssd_chunk_state_local_pair({x.data(), Bm.data(), dto.data(), dac.data(), seqp, cstP.data(), L, H, P, G, N, Q, nc}); });
        launch({(unsigned)((P * N + (vec4 ? 1023 : 255)) / (vec4 ? 1024 : 256)), (unsigned)H, (unsigned)B}, 256, 0, [&] {
            ssd_state_passing({dac.data(), initp, seqp, cstP.data(), finP.data(), L, H, P, N, Q, nc, vec4}); });
    }
    int tmax = (std::min(Q, L) + 63) / 64, npairs = tmax * (tmax + 1) / 2;
    std::vector<float> cbuf((size_t)B * nc * G * npairs * 4096, NAN), cbuf4(cbuf.size(), NAN);
    auto run_cb = [&](std::vector<float>& cb, int vec) {
        launch({(unsigned)(nc * npairs), (unsigned)G, (unsigned)B}, 128, ssd_chunk_cb_layout.smem[0], [&] {
            ssd_chunk_cb({Bm.data(), Cm.data(), cb.data(), L, G, N, Q, nc, tmax, vec}); });
    };
    run_cb(cbuf, N % 4 == 0 ? 1 : 0);
    if (N % 4 == 0) run_cb(cbuf4, 0); else cbuf4 = cbuf;
    // rows: 128 (ssd_compute_out_cb128, what the host launches when tmax >= 2) or 64.
    auto run_cb_out = [&](std::vector<float>& out, int vec, int rows) {
        launch({(unsigned)(nc * ((Q + rows - 1) / rows)), (unsigned)(H * ptiles), (unsigned)B}, 2 * rows, (rows == 128 ? ssd_compute_out_cb128_layout : ssd_compute_out_cb_layout).smem[0], [&] {
            if (rows == 128)
                ssd_compute_out_cb128({x.data(), Cm.data(), Dv.data(), zp, dto.data(), dac.data(), cstN.data(), seqp, cbuf.data(), out.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0, tmax, vec});
            else
                ssd_compute_out_cb({x.data(), Cm.data(), Dv.data(), zp, dto.data(), dac.data(), cstN.data(), seqp, cbuf.data(), out.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0, tmax, vec}); });
    };
    const int vec16 = (P % 4 == 0 && N % 4 == 0) ? 1 : 0;
    const int rows = tmax >= 2 ? 128 : 64;
    run_cb_out(outN, vec16, rows);
    std::vector<float> outS(nx, NAN);
    if (vec16) run_cb_out(outS, 0, rows); else outS = outN;
    std::vector<float> out64(nx, NAN);
    if (rows == 128) run_cb_out(out64, vec16, 64); else out64 = outN;
    // the pair kernel (two units per block), where the host would launch it
    const int units_per_group = H / G * ptiles;
    const bool pairs = tmax >= 2 && vec16 && units_per_group % 2 == 0;
    std::vector<float> outP(nx, NAN);
    if (pairs)
        launch({(unsigned)(nc * ((Q + 127) / 128)), (unsigned)(H * ptiles / 2), (unsigned)B}, 256, ssd_compute_out_pair_layout.smem[0], [&] {
            ssd_compute_out_pair({x.data(), Cm.data(), Dv.data(), zp, dto.data(), dac.data(), cstN.data(), seqp, cbuf.data(), outP.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0, tmax, 1}); });
    run_old_out(cstN, outLN);
    // tol: max |diff| allowed, relative to max(max|ref|, 1). Version 2's kernels feed raw f32
    // operands and 2^x instead of TF32-rounded ones and exp (5e-3, about 10 TF32 units): a
    // wrong mask, decay or index errs by the size of the output itself.
    auto cmp = [](const char* name, std::vector<float>& a, std::vector<float>& b, double tol) {
        double worst = 0, mag = 0; size_t nan = 0, diff = 0;
        for (size_t i = 0; i < a.size(); ++i) { if (std::isnan(a[i]) || std::isnan(b[i])) { nan++; continue; } if (memcmp(&a[i], &b[i], 4)) diff++; worst = std::max(worst, (double)fabsf(a[i] - b[i])); mag = std::max(mag, (double)fabsf(b[i])); }
        printf("%-28s n=%zu nan=%zu differing=%zu max|diff|=%.3g max|ref|=%.3g\n", name, a.size(), nan, diff, worst, mag);
        return nan + (worst > tol * std::max(mag, 1.0) ? 1 : 0);
    };
    size_t nans = 0;
    nans += cmp("chunk_states new vs legacy", cstN, cstL, 5e-3);
    nans += cmp("final_states new vs legacy", finN, finL, 5e-3);
    nans += cmp("out new vs legacy", outN, outL, 5e-3);
    nans += cmp("out new vs old-kernel(newS)", outN, outLN, 5e-3);
    nans += cmp("out 16-byte vs 4-byte copies", outN, outS, 0.0);
    {   // the scores that blocks wrote (a pair past seqlen is never written nor read)
        std::vector<float> a, b2;
        for (size_t i = 0; i < cbuf.size(); ++i) if (!std::isnan(cbuf[i]) || !std::isnan(cbuf4[i])) { a.push_back(cbuf[i]); b2.push_back(cbuf4[i]); }
        nans += cmp("scores 16-byte vs 4-byte copies", a, b2, 0.0);
    }
    nans += cmp("out 64-row blocks vs legacy", out64, outL, 5e-3);
    if (state_pairs) {
        nans += cmp("chunk_states pair 2a vs 2a", cstP, cstN, 5e-3);
        nans += cmp("final_states pair 2a vs 2a", finP, finN, 5e-3);
    } else {
        printf("pair 2a: not applicable\n");
    }
    if (pairs) {
        nans += cmp("out pair kernel vs legacy", outP, outL, 5e-3);
        nans += cmp("out pair kernel vs cb kernel", outP, outN, 5e-3);
    } else {
        printf("pair kernel: not applicable\n");
    }
    // The chained stage 2 (2a and 2b in one kernel), where the host would launch it: the same
    // bits as pair 2a and the pass.
    if (state_pairs && N <= 128) {
        std::vector<float> cstC(nst, NAN), finC(nfs, NAN);
        std::vector<int> chain(1 + (size_t)B * (H * ptiles / 2) * nc, 0);
        launch({(unsigned)(B * (H * ptiles / 2) * nc), 1, 1}, 256, ssd_state_chained_layout.smem[0], [&] {
            ssd_state_chained({x.data(), Bm.data(), dto.data(), dac.data(), initp, seqp, cstC.data(), finC.data(), chain.data(), L, H, P, G, N, Q, nc, B}); });
        nans += cmp("chained chunk_states vs pairs", cstC, cstP, 0.0);
        nans += cmp("chained final_states vs pairs", finC, finP, 0.0);
        // The walking stage 2 in f32 (1, 2 or 5 units a block where they divide a group's): the
        // same TF32 terms, summed onto the decayed state.
        const int upg = H / G * ptiles;
        for (int hb : {1, 2, 5}) {
            if (upg % hb) continue;
            const size_t smem = hb == 1 ? ssd_state_walk_1_layout.smem[0]
                              : hb == 2 ? ssd_state_walk_2_layout.smem[0]
                                        : ssd_state_walk_5_layout.smem[0];
            std::vector<float> cstW(nst, NAN), finW(nfs, NAN);
            launch({(unsigned)(B * H * ptiles / hb), 1, 1}, 128 * hb, smem, [&] {
                const StateChainedParams prm = {x.data(), Bm.data(), dto.data(), dac.data(), initp, seqp, cstW.data(), finW.data(), nullptr, L, H, P, G, N, Q, nc, B, nullptr};
                if (hb == 1) ssd_state_walk_1(prm);
                else if (hb == 2) ssd_state_walk_2(prm);
                else ssd_state_walk_5(prm); });
            char name[64];
            snprintf(name, sizeof name, "walk%d f32 chunk_states vs pairs", hb);
            nans += cmp(name, cstW, cstP, 1e-4);
            snprintf(name, sizeof name, "walk%d f32 final_states vs pairs", hb);
            nans += cmp(name, finW, finP, 1e-4);
        }
    } else {
        printf("chained stage 2: not applicable\n");
    }
    // The segmented walk in f32 (one unit and 128 dstate columns a block, dstate up to 256, no
    // seq_idx), segments of 1 and 2 chunks: phase 0, the combination, phase 1; the same TF32
    // terms, summed onto the decayed state and combined at the segment boundaries.
    if (state_pairs && !seqp && nc >= 2) {
        const unsigned units = (unsigned)(H * ptiles * ((N + 127) / 128));
        for (int per : {1, 2}) {
            const int nseg = (nc + per - 1) / per;
            std::vector<float> cstS(nst, NAN), finS(nfs, NAN);
            auto prm = [&](int phase) {
                return StateWalkSegParams{{x.data(), Bm.data(), dto.data(), dac.data(), initp, nullptr, cstS.data(), finS.data(), nullptr, L, H, P, G, N, Q, nc, B, nullptr}, {per, nseg, phase, 1}};
            };
            const size_t smem = ssd_state_walk_seg_1_layout.smem[0];
            if (nseg > 1) {
                launch({units, (unsigned)(nseg - 1), (unsigned)B}, 128, smem, [&] { ssd_state_walk_seg_1(prm(0)); });
                launch({(unsigned)((nfs / 2 + 255) / 256), 1, 1}, 256, 0, [&] { ssd_state_walk_seg_combine(prm(0)); });
            }
            launch({units, (unsigned)nseg, (unsigned)B}, 128, smem, [&] { ssd_state_walk_seg_1(prm(1)); });
            char name[80];
            snprintf(name, sizeof name, "walk seg%d f32 chunk_states vs pairs", per);
            nans += cmp(name, cstS, cstP, 1e-4);
            snprintf(name, sizeof name, "walk seg%d f32 final_states vs pairs", per);
            nans += cmp(name, finS, finP, 1e-4);
        }
    } else {
        printf("segmented walk: not applicable\n");
    }
    // bf16 I/O, where the host runs the bf16 kernels (the pair kernels' shapes, headdim and
    // dstate multiples of 8): x, B, C, z rounded to bf16; the bf16 kernels against version 1 in
    // f32 on the same rounded values, within 3e-2 of the largest magnitude (bf16 operands: 2^-8
    // each), and the conversion kernels exact.
    if (pairs && state_pairs && P % 8 == 0 && N % 8 == 0) {
        auto to_bf16 = [](const std::vector<float>& v, std::vector<unsigned short>& h, std::vector<float>& r) {
            h.resize(v.size()); r.resize(v.size());
            for (size_t i = 0; i < v.size(); ++i) { h[i] = (unsigned short)emu_bf16_rne(v[i]); r[i] = emu_lo(h[i]); }
        };
        std::vector<unsigned short> xh, bh, ch, zh;
        std::vector<float> xr, br, cr, zr;
        to_bf16(x, xh, xr); to_bf16(Bm, bh, br); to_bf16(Cm, ch, cr); to_bf16(z, zh, zr);
        const float* zrp = zp ? zr.data() : nullptr;
        const unsigned short* zhp = zp ? zh.data() : nullptr;
        std::vector<float> cstR(nst, NAN), finR(nfs, NAN), outR(nx, NAN);
        launch({(unsigned)(ptiles * ntiles), (unsigned)H, (unsigned)B}, 128, 0, [&] {
            ssd_fwd_pass_state({xr.data(), br.data(), dto.data(), dac.data(), initp, seqp, cstR.data(), finR.data(), L, H, P, G, N, Q, nc}); });
        launch({(unsigned)(nc * itiles), (unsigned)(H * ptiles), (unsigned)B}, 128, smem_old, [&] {
            ssd_compute_out({xr.data(), br.data(), cr.data(), Dv.data(), zrp, dto.data(), dac.data(), cstR.data(), seqp, outR.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0}); });
        std::vector<float> cstH(nst, NAN), finH(nfs, NAN), cbufH(cbuf.size(), NAN), outH(nx, NAN);
        std::vector<unsigned short> outh(nx, 0xffff), loH(nst, 0xffff);
        launch({(unsigned)(nc * ((N + 127) / 128) * (H * ptiles / 2)), 1, (unsigned)B}, 256, ssd_chunk_state_local_pair_bf16_layout.smem[0], [&] {
            ssd_chunk_state_local_pair_bf16({xh.data(), bh.data(), dto.data(), dac.data(), seqp, cstH.data(), L, H, P, G, N, Q, nc}); });
        // The lean pass (chunk_states not kept), on a copy of 2a's own states: chunk_states left
        // as 2a wrote it, and the same bf16 copy and final states as the pass below.
        std::vector<float> cstHL = cstH, finHL(nfs, NAN);
        std::vector<unsigned short> loHL(nst, 0xffff);
        launch({(unsigned)((P * N + (vec4 ? 1023 : 255)) / (vec4 ? 1024 : 256)), (unsigned)H, (unsigned)B}, 256, 0, [&] {
            ssd_state_passing({dac.data(), initp, seqp, cstHL.data(), finHL.data(), L, H, P, N, Q, nc, vec4, 1, nullptr, nullptr, loHL.data()}); });
        const size_t lean_touched = std::memcmp(cstHL.data(), cstH.data(), nst * sizeof(float)) != 0;
        launch({(unsigned)((P * N + (vec4 ? 1023 : 255)) / (vec4 ? 1024 : 256)), (unsigned)H, (unsigned)B}, 256, 0, [&] {
            ssd_state_passing({dac.data(), initp, seqp, cstH.data(), finH.data(), L, H, P, N, Q, nc, vec4, 0, nullptr, nullptr, loH.data()}); });
        {
            size_t bad = lean_touched;
            for (size_t i = 0; i < nst; ++i) bad += loHL[i] != loH[i];
            for (size_t i = 0; i < (size_t)nfs; ++i) bad += std::memcmp(&finHL[i], &finH[i], 4) != 0;
            printf("bf16 lean 2b vs 2b (states_lo, final_states; chunk_states rewritten: %zu): %zu differ\n", lean_touched, bad);
            nans += bad;
        }
        size_t lo_bad = 0;  // the pass's bf16 copy: chunk_states rounded to nearest even
        for (size_t i = 0; i < nst; ++i) lo_bad += loH[i] != (unsigned short)emu_bf16_rne(cstH[i]);
        printf("bf16 states_lo mismatches (2b): %zu\n", lo_bad);
        nans += lo_bad;
        launch({(unsigned)(nc * npairs), (unsigned)G, (unsigned)B}, 128, ssd_chunk_cb_bf16_layout.smem[0], [&] {
            ssd_chunk_cb_bf16({bh.data(), ch.data(), cbufH.data(), L, G, N, Q, nc, tmax, 1}); });
        launch({(unsigned)(nc * ((Q + 127) / 128)), (unsigned)(H * ptiles / 2), (unsigned)B}, 256, ssd_compute_out_pair_bf16_layout.smem[0], [&] {
            ssd_compute_out_pair_bf16({xh.data(), ch.data(), Dv.data(), zhp, dto.data(), dac.data(), loH.data(), seqp, cbufH.data(), outh.data(), L, H, P, G, N, Q, nc, (opts & 8) ? 1 : 0, initp ? 1 : 0, tmax, 1}); });
        launch({(unsigned)((nx + 255) / 256), 1, 1}, 256, 0, [&] { ssd_widen_bf16({outh.data(), outH.data(), (long long)nx}); });
#ifdef SSD_EMU_SM90
        // The Hopper output kernel, where the host runs it (headdim 64, dstate 128 with chunks of
        // 128 or 256, or dstate 256 with chunks of 128 on ssd_compute_out_wg_bf16_n256, no seq_idx,
        // pairs of heads within a group), on 3 persistent blocks: the pair
        // kernel's operands and rounding points, its own scores (f32 sums in another order), so a
        // bf16 rounding of a decayed score or of out may land one unit (2^-8) apart: within 1e-2
        // of the largest magnitude (2.5 such units), where a wrong tile, decay or mask errs by the
        // size of out itself.
        if (P == 64 && ((N == 128 && (Q == 128 || Q == 256)) || (N == 256 && Q == 128)) && !seqp && (H / G) % 2 == 0) {
            std::vector<unsigned short> outwh(nx, 0xffff);
            std::vector<float> outW(nx, NAN);
            ComputeOutWgBf16Params wp;
            const long long xw = (long long)H * P, bw = (long long)G * N;
            emu_tmap_3d(&wp.tm_x, xh.data(), xw, L, B, 2 * xw, 2 * xw * L);
            emu_tmap_3d(&wp.tm_c, ch.data(), bw, L, B, 2 * bw, 2 * bw * L);
            emu_tmap_3d(&wp.tm_b, bh.data(), bw, L, B, 2 * bw, 2 * bw * L);
            emu_tmap_3d(&wp.tm_s, loH.data(), N, P, (long long)B * nc * H, 2 * N, 2LL * P * N);
            emu_tmap_3d(&wp.tm_out, outwh.data(), xw, L, B, 2 * xw, 2 * xw * L);
            wp.Dv = Dv.data();
            wp.z = zhp;
            wp.dt_out = dto.data();
            wp.dA_cumsum = dac.data();
            wp.seqlen = L; wp.nheads = H; wp.headdim = P; wp.ngroups = G; wp.dstate = N; wp.chunk_size = Q;
            wp.nchunks = nc; wp.d_per_channel = (opts & 8) ? 1 : 0; wp.has_initial_states = initp ? 1 : 0; wp.batch = B;
            if (N == 128)
                launch({3, 1, 1}, 384, sizeof(ComputeOutWgBf16Smem) + 1024, [&] { ssd_compute_out_wg_bf16(wp); });
            else
                launch({3, 1, 1}, 384, sizeof(ComputeOutWgBf16N256Smem) + 1024, [&] { ssd_compute_out_wg_bf16_n256(wp); });
            launch({(unsigned)((nx + 255) / 256), 1, 1}, 256, 0, [&] { ssd_widen_bf16({outwh.data(), outW.data(), (long long)nx}); });
            nans += cmp(N == 128 ? "bf16 out Hopper kernel vs pair kernel" : "bf16 out Hopper kernel (dstate 256) vs pair kernel", outW, outH, 1e-2);
            // SSD_EMU_DUMP=FILE: its bf16 out written to FILE, to compare two builds' bits.
            if (const char* dump = getenv("SSD_EMU_DUMP")) {
                FILE* f = fopen(dump, "wb");
                if (!f || fwrite(outwh.data(), 2, nx, f) != nx || fclose(f) != 0) { fprintf(stderr, "cannot write %s\n", dump); return 2; }
            }
        } else {
            printf("bf16 Hopper output kernel: not applicable\n");
        }
#endif
        if (N <= 128) {  // the chained stage 2 in bf16: the same bits as the two launches above
            std::vector<float> cstHC(nst, NAN), finHC(nfs, NAN);
            std::vector<int> chain(1 + (size_t)B * (H * ptiles / 2) * nc, 0);
            std::vector<unsigned short> loHC(nst, 0xffff);
            launch({(unsigned)(B * (H * ptiles / 2) * nc), 1, 1}, 256, ssd_state_chained_bf16_layout.smem[0], [&] {
                ssd_state_chained_bf16({xh.data(), bh.data(), dto.data(), dac.data(), initp, seqp, cstHC.data(), finHC.data(), chain.data(), L, H, P, G, N, Q, nc, B, loHC.data()}); });
            nans += cmp("chained bf16 chunk_states vs pairs", cstHC, cstH, 0.0);
            size_t lo_diff = 0;
            for (size_t i = 0; i < nst; ++i) lo_diff += loHC[i] != loH[i];
            printf("chained bf16 states_lo vs 2b: %zu differ\n", lo_diff);
            nans += lo_diff;
            nans += cmp("chained bf16 final_states vs pairs", finHC, finH, 0.0);
            // Without chunk_states (the outputs do not keep it): the same bf16 copy and final
            // states.
            std::vector<float> finHL(nfs, NAN);
            std::vector<unsigned short> loHL(nst, 0xffff);
            std::fill(chain.begin(), chain.end(), 0);
            launch({(unsigned)(B * (H * ptiles / 2) * nc), 1, 1}, 256, ssd_state_chained_bf16_layout.smem[0], [&] {
                ssd_state_chained_bf16({xh.data(), bh.data(), dto.data(), dac.data(), initp, seqp, nullptr, finHL.data(), chain.data(), L, H, P, G, N, Q, nc, B, loHL.data()}); });
            size_t lean_diff = 0;
            for (size_t i = 0; i < nst; ++i) lean_diff += loHL[i] != loH[i];
            printf("chained bf16 states_lo without chunk_states vs 2b: %zu differ\n", lean_diff);
            nans += lean_diff;
            nans += cmp("chained bf16 final_states without chunk_states vs pairs", finHL, finH, 0.0);
        }
        if (N <= 128) {  // the walking stage 2 (1, 2 or 5 units a block where they divide a group's)
            const int upg = H / G * ptiles;
            for (int hb : {1, 2, 5}) {
                if (upg % hb) continue;
                const size_t smem = hb == 1 ? ssd_state_walk_bf16_1_layout.smem[0]
                                  : hb == 2 ? ssd_state_walk_bf16_2_layout.smem[0]
                                            : ssd_state_walk_bf16_5_layout.smem[0];
                auto walk = [&](float* cst, float* fin, unsigned short* lo) {
                    launch({(unsigned)(B * H * ptiles / hb), 1, 1}, 128 * hb, smem, [&] {
                        const StateChainedBf16Params prm = {xh.data(), bh.data(), dto.data(), dac.data(), initp, seqp, cst, fin, nullptr, L, H, P, G, N, Q, nc, B, lo};
                        if (hb == 1) ssd_state_walk_bf16_1(prm);
                        else if (hb == 2) ssd_state_walk_bf16_2(prm);
                        else ssd_state_walk_bf16_5(prm); });
                };
                std::vector<float> cstW(nst, NAN), finW(nfs, NAN), finWL(nfs, NAN);
                std::vector<unsigned short> loW(nst, 0xffff), loWL(nst, 0xffff);
                walk(cstW.data(), finW.data(), loW.data());
                walk(nullptr, finWL.data(), loWL.data());
                // The same bf16 terms, summed onto the decayed state: f32 rounding apart.
                char name[64];
                snprintf(name, sizeof name, "walk%d chunk_states vs pairs", hb);
                nans += cmp(name, cstW, cstH, 1e-4);
                snprintf(name, sizeof name, "walk%d final_states vs pairs", hb);
                nans += cmp(name, finW, finH, 1e-4);
                std::vector<float> loWf(nst), loHf(nst);
                size_t rne_bad = 0, lean_bad = 0;
                for (size_t i = 0; i < nst; ++i) {
                    loWf[i] = emu_lo(loW[i]); loHf[i] = emu_lo(loH[i]);
                    rne_bad += loW[i] != (unsigned short)emu_bf16_rne(cstW[i]);
                    lean_bad += loWL[i] != loW[i];
                }
                for (size_t i = 0; i < (size_t)nfs; ++i) lean_bad += std::memcmp(&finWL[i], &finW[i], 4) != 0;
                snprintf(name, sizeof name, "walk%d states_lo vs 2b", hb);
                nans += cmp(name, loWf, loHf, 1e-2);
                printf("walk%d states_lo vs its chunk_states rounded: %zu differ; without chunk_states: %zu differ\n", hb, rne_bad, lean_bad);
                nans += rne_bad + lean_bad;
            }
        }
        // The segmented walk in bf16 (as in f32 above), kept and not kept (the bf16 copy and final
        // states alone in phase 1; chunk_states is still the phases' scratch).
        if (!seqp && nc >= 2) {
            const unsigned units = (unsigned)(H * ptiles * ((N + 127) / 128));
            for (int per : {1, 2}) {
                const int nseg = (nc + per - 1) / per;
                auto walk = [&](std::vector<float>& cst, std::vector<float>& fin, std::vector<unsigned short>& lo, int keep) {
                    auto prm = [&](int phase) {
                        return StateWalkSegBf16Params{{xh.data(), bh.data(), dto.data(), dac.data(), initp, nullptr, cst.data(), fin.data(), nullptr, L, H, P, G, N, Q, nc, B, lo.data()}, {per, nseg, phase, keep}};
                    };
                    const size_t smem = ssd_state_walk_seg_bf16_1_layout.smem[0];
                    if (nseg > 1) {
                        launch({units, (unsigned)(nseg - 1), (unsigned)B}, 128, smem, [&] { ssd_state_walk_seg_bf16_1(prm(0)); });
                        launch({(unsigned)((nfs / 2 + 255) / 256), 1, 1}, 256, 0, [&] {
                            const StateWalkSegBf16Params q = prm(0);
                            ssd_state_walk_seg_combine(StateWalkSegParams{{nullptr, nullptr, q.c.dt_out, q.c.dA_cumsum, q.c.initial_states, nullptr, q.c.chunk_states, q.c.final_states, nullptr, L, H, P, G, N, Q, nc, B, nullptr}, q.sg});
                        });
                    }
                    launch({units, (unsigned)nseg, (unsigned)B}, 128, smem, [&] { ssd_state_walk_seg_bf16_1(prm(1)); });
                };
                std::vector<float> cstS(nst, NAN), finS(nfs, NAN), cstSL(nst, NAN), finSL(nfs, NAN);
                std::vector<unsigned short> loS(nst, 0xffff), loSL(nst, 0xffff);
                walk(cstS, finS, loS, 1);
                walk(cstSL, finSL, loSL, 0);
                char name[80];
                snprintf(name, sizeof name, "walk seg%d chunk_states vs pairs", per);
                nans += cmp(name, cstS, cstH, 1e-4);
                snprintf(name, sizeof name, "walk seg%d final_states vs pairs", per);
                nans += cmp(name, finS, finH, 1e-4);
                size_t rne_bad = 0, lean_bad = 0;
                for (size_t i = 0; i < nst; ++i) {
                    rne_bad += loS[i] != (unsigned short)emu_bf16_rne(cstS[i]);
                    lean_bad += loSL[i] != loS[i];
                }
                for (size_t i = 0; i < (size_t)nfs; ++i) lean_bad += std::memcmp(&finSL[i], &finS[i], 4) != 0;
                printf("walk seg%d states_lo vs its chunk_states rounded: %zu differ; not kept: %zu differ\n", per, rne_bad, lean_bad);
                nans += rne_bad + lean_bad;
            }
        }
        nans += cmp("bf16 chunk_states vs v1", cstH, cstR, 3e-2);
        nans += cmp("bf16 final_states vs v1", finH, finR, 3e-2);
        nans += cmp("bf16 out vs v1", outH, outR, 3e-2);
        std::vector<unsigned short> back(nx, 0);
        launch({(unsigned)((nx + 255) / 256), 1, 1}, 256, 0, [&] { ssd_narrow_bf16({outR.data(), back.data(), (long long)nx}); });
        size_t conv_bad = 0;
        for (size_t i = 0; i < nx; ++i) conv_bad += back[i] != (unsigned short)emu_bf16_rne(outR[i]);
        printf("bf16 narrow mismatches: %zu\n", conv_bad);
        nans += conv_bad;
    } else {
        printf("bf16 kernels: not applicable\n");
    }
    if (packed) nans += packed_path(cu, seq, x, Bm, Cm, z, Dv, zp, dto, dac, A, L, H, P, G, N, Q, nc, opts, rng, cmp);
    printf("RESULT %s\n", nans ? "NAN or large difference" : "ok");
}
