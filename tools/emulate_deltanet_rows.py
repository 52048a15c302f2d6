#!/usr/bin/env python3
"""Fragment-level emulation of kernels/deltanet_rows.cu (`chunk_scan_rows`) without a GPU.

Why: the row-state scan feeds each product's A operand from the previous product's mma.sync
accumulators with a relabelled k order, and reads T and P in the prep's transposed layout; an
index slip there is silent until a device runs tests/gpu. This replays the kernel's per-lane
index arithmetic (m16n8k8 TF32 fragment layouts, f64, exact products) warp by warp for every
column block, and compares outputs and the final state with the plain chunked delta rule (the
tc scans' mathematics, itself checked against the CPU twin on the device). Keep it in step with
the kernel when its indexing changes; mutating one index makes it report errors of ~1e-2.

Usage (numpy needed): python3 tools/emulate_deltanet_rows.py  -> one line per case, errors ~1e-16.
"""
import numpy as np

CHUNK = 64
rng = np.random.default_rng(1)


def mma(D, A, B):
    """D[16x8] += A[16x8] B[8x8] given per-lane fragments (lists of 32 tuples)."""
    Am = np.zeros((16, 8)); Bm = np.zeros((8, 8))
    for lane in range(32):
        gr, tg = lane >> 2, lane & 3
        a = A[lane]; b = B[lane]
        Am[gr, tg] = a[0]; Am[gr + 8, tg] = a[1]; Am[gr, tg + 4] = a[2]; Am[gr + 8, tg + 4] = a[3]
        Bm[tg, gr] = b[0]; Bm[tg + 4, gr] = b[1]
    Cm = Am @ Bm
    for lane in range(32):
        gr, tg = lane >> 2, lane & 3
        D[lane][0] += Cm[gr, 2 * tg]; D[lane][1] += Cm[gr, 2 * tg + 1]
        D[lane][2] += Cm[gr + 8, 2 * tg]; D[lane][3] += Cm[gr + 8, 2 * tg + 1]


def prep(kc, qc, bet, gam_cum):
    """T, P of one chunk (64 rows, zero past len) stored transposed as the prep does."""
    n = CHUNK
    A = np.zeros((n, n)); P = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            e = np.exp(gam_cum[i] - gam_cum[j])
            if j < i: A[i, j] = bet[i] * (kc[i] @ kc[j]) * e
            if j <= i: P[i, j] = (qc[i] @ kc[j]) * e
    T = np.linalg.inv(np.eye(n) + A)
    return T.T.copy(), P.T.copy()   # [j][i] = T[i][j]


def reference(q, k, v, beta, g, S0, chunks):
    """Plain chunked delta rule (the pipelined kernel's mathematics), one value head, S [dk][dv]."""
    S = S0.copy(); out = np.zeros_like(v)
    for (r0, ln) in chunks:
        K = np.zeros((CHUNK, k.shape[1])); Q = np.zeros_like(K); V = np.zeros((CHUNK, v.shape[1]))
        K[:ln] = k[r0:r0 + ln]; Q[:ln] = q[r0:r0 + ln]; V[:ln] = v[r0:r0 + ln]
        gg = np.zeros(CHUNK); bb = np.zeros(CHUNK); gg[:ln] = g[r0:r0 + ln]; bb[:ln] = beta[r0:r0 + ln]
        gam = np.cumsum(gg)
        Tt, Pt = prep(K, Q, bb, gam)
        T, P = Tt.T, Pt.T
        eg = np.exp(gam)
        R = bb[:, None] * (V - eg[:, None] * (K @ S))
        Vn = T @ R
        O = eg[:, None] * (Q @ S) + P @ Vn
        out[r0:r0 + ln] = O[:ln]
        fac = np.exp(gam[-1] - gam)
        S = np.exp(gam[-1]) * S + (fac[:, None] * K).T @ Vn
    return out, S


def kernel(q, k, v, beta, g, S0, chunks, NW, dv):
    """chunk_scan_rows for one (sequence, value head), every column block, as the kernel does it."""
    DK = k.shape[1]; COLS = 16 * NW; NTD = DK // 8
    out = np.zeros((q.shape[0], dv)); Sfin = np.zeros((DK, dv))
    for c0 in range(0, dv, COLS):
        # per warp, per lane: S[nt][e]
        S = [[[[S0[8 * nt + 2 * (l & 3) + (e & 1), c0 + 16 * w + (l >> 2) + 8 * (e >> 1)] for e in range(4)]
               for nt in range(NTD)] for l in range(32)] for w in range(NW)]
        for (r0, ln) in chunks:
            # shared tiles
            K = np.zeros((CHUNK, DK)); Q = np.zeros_like(K); V = np.zeros((CHUNK, COLS))
            K[:ln] = k[r0:r0 + ln]; Q[:ln] = q[r0:r0 + ln]; V[:ln] = v[r0:r0 + ln, c0:c0 + COLS]
            gg = np.zeros(CHUNK); bb = np.zeros(CHUNK); gg[:ln] = g[r0:r0 + ln]; bb[:ln] = beta[r0:r0 + ln]
            gam = np.cumsum(gg)
            Ts, Ps = prep(K, Q, bb, gam)        # as stored: Ts[r][c]
            G = np.concatenate([np.exp(gam), np.exp(gam[-1] - gam), bb])
            tiles = (ln + 7) >> 3
            for w in range(NW):
                cw = 16 * w
                Sw = S[w]
                r = [[[0.0] * 4 for _ in range(8)] for _ in range(32)]
                for kk in range(NTD):
                    A = [(Sw[l][kk][0], Sw[l][kk][2], Sw[l][kk][1], Sw[l][kk][3]) for l in range(32)]
                    for nt in range(8):
                        if nt < tiles:
                            B = [(K[8 * nt + (l >> 2), 8 * kk + 2 * (l & 3)], K[8 * nt + (l >> 2), 8 * kk + 2 * (l & 3) + 1]) for l in range(32)]
                            D = [r[l][nt] for l in range(32)]
                            mma(D, A, B)
                for l in range(32):
                    gr, tg = l >> 2, l & 3
                    for nt in range(8):
                        for e in range(4):
                            i = 8 * nt + 2 * tg + (e & 1); c = cw + gr + 8 * (e >> 1)
                            r[l][nt][e] = G[2 * CHUNK + i] * (V[i, c] - G[i] * r[l][nt][e])
                vn = [[[0.0] * 4 for _ in range(8)] for _ in range(32)]
                for kk in range(8):
                    if kk < tiles:
                        A = [(r[l][kk][0], r[l][kk][2], r[l][kk][1], r[l][kk][3]) for l in range(32)]
                        for nt in range(kk, 8):
                            if nt < tiles:
                                B = [(Ts[8 * kk + 2 * (l & 3), 8 * nt + (l >> 2)], Ts[8 * kk + 2 * (l & 3) + 1, 8 * nt + (l >> 2)]) for l in range(32)]
                                D = [vn[l][nt] for l in range(32)]
                                mma(D, A, B)
                o = [[[0.0] * 4 for _ in range(8)] for _ in range(32)]
                for kk in range(NTD):
                    A = [(Sw[l][kk][0], Sw[l][kk][2], Sw[l][kk][1], Sw[l][kk][3]) for l in range(32)]
                    for nt in range(8):
                        if nt < tiles:
                            B = [(Q[8 * nt + (l >> 2), 8 * kk + 2 * (l & 3)], Q[8 * nt + (l >> 2), 8 * kk + 2 * (l & 3) + 1]) for l in range(32)]
                            D = [o[l][nt] for l in range(32)]
                            mma(D, A, B)
                for l in range(32):
                    tg = l & 3
                    for nt in range(8):
                        for e in range(4):
                            o[l][nt][e] *= G[8 * nt + 2 * tg + (e & 1)]
                for kk in range(8):
                    if kk < tiles:
                        A = [(vn[l][kk][0], vn[l][kk][2], vn[l][kk][1], vn[l][kk][3]) for l in range(32)]
                        for nt in range(kk, 8):
                            if nt < tiles:
                                B = [(Ps[8 * kk + 2 * (l & 3), 8 * nt + (l >> 2)], Ps[8 * kk + 2 * (l & 3) + 1, 8 * nt + (l >> 2)]) for l in range(32)]
                                D = [o[l][nt] for l in range(32)]
                                mma(D, A, B)
                for l in range(32):
                    gr, tg = l >> 2, l & 3
                    for nt in range(8):
                        for e in range(4):
                            i = 8 * nt + 2 * tg + (e & 1)
                            if i < ln:
                                out[r0 + i, c0 + cw + gr + 8 * (e >> 1)] = o[l][nt][e]
                el = G[CHUNK - 1]
                for l in range(32):
                    for nt in range(NTD):
                        for e in range(4):
                            Sw[l][nt][e] *= el
                for kk in range(8):
                    if kk < tiles:
                        A = []
                        for l in range(32):
                            j = 8 * kk + 2 * (l & 3)
                            f0, f1 = G[CHUNK + j], G[CHUNK + j + 1]
                            A.append((f0 * vn[l][kk][0], f0 * vn[l][kk][2], f1 * vn[l][kk][1], f1 * vn[l][kk][3]))
                        for nt in range(NTD):
                            B = [(K[8 * kk + 2 * (l & 3), 8 * nt + (l >> 2)], K[8 * kk + 2 * (l & 3) + 1, 8 * nt + (l >> 2)]) for l in range(32)]
                            D = [Sw[l][nt] for l in range(32)]
                            mma(D, A, B)
        for w in range(NW):
            for l in range(32):
                for nt in range(NTD):
                    for e in range(4):
                        Sfin[8 * nt + 2 * (l & 3) + (e & 1), c0 + 16 * w + (l >> 2) + 8 * (e >> 1)] = S[w][l][nt][e]
    return out, Sfin


def case(n, DK, dv, NW):
    k = rng.normal(size=(n, DK)); k /= np.linalg.norm(k, axis=1, keepdims=True)
    q = rng.normal(size=(n, DK)); q /= np.linalg.norm(q, axis=1, keepdims=True) * np.sqrt(DK)
    v = rng.normal(size=(n, dv))
    beta = 1 / (1 + np.exp(-rng.normal(size=n)))
    g = -np.exp(rng.normal(size=n) - 1.0)
    S0 = rng.normal(size=(DK, dv)) * 0.1
    chunks = [(r, min(CHUNK, n - r)) for r in range(0, n, CHUNK)]
    o_ref, s_ref = reference(q, k, v, beta, g, S0, chunks)
    o, s = kernel(q, k, v, beta, g, S0, chunks, NW, dv)
    print(f"n={n} dk={DK} dv={dv} NW={NW}: |O-ref| {np.abs(o - o_ref).max():.2e} (|ref| {np.abs(o_ref).max():.2e}), "
          f"|S-ref| {np.abs(s - s_ref).max():.2e} (|ref| {np.abs(s_ref).max():.2e})")


case(73, 16, 32, 2)
case(130, 32, 64, 2)
case(9, 16, 128, 8)
case(65, 128, 32, 2)
case(130, 64, 128, 4)
