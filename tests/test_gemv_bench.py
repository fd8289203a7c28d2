"""`deepinfer bench gemv` on the CPU: which kernels it times at each token count, and how its tables label the
attention rows (the sweep itself needs a GPU)."""

from __future__ import annotations

from deepinfer.core.bench.gemv_bench import bandwidth_checks, gemv_tables, product_floor_us, quant_points


def test_bench_times_every_kernel_that_serves_a_token_count():
    assert quant_points(1) == ["tc", "tcs", "gemv", "stream", "ksplit", "staged", "fragment"]
    assert quant_points(4, tc_takes=False) == ["gemv", "stream", "ksplit", "staged", "fragment"]
    # from 16 tokens: the W4 GEMM, the dense path and cuBLAS on the dense weight
    assert quant_points(16) == ["tc", "tcs", "ksplit", "staged", "fragment", "fragment_batch", "w4_gemm", "dense",
                                "cublas"]
    assert quant_points(32) == ["tc", "tcs", "ksplit", "staged", "fragment", "fragment_batch", "w4_gemm", "dense",
                                "cublas"]
    assert quant_points(33) == ["staged", "fragment", "fragment_batch", "w4_gemm", "dense", "cublas"]  # tc, ksplit: to 32
    assert quant_points(65) == ["fragment_batch", "w4_gemm", "dense", "cublas"]  # the few-token fragment kernel: to 64
    assert quant_points(256) == ["fragment_batch", "w4_gemm", "dense", "cublas"]
    assert quant_points(257) == ["dense", "cublas"]  # the 33-128-token fragment kernel and the GEMM: up to 256 tokens
    assert quant_points(64, bits=3) == ["staged", "dense", "cublas"]  # the GEMM and fragment read 4-bit codes
    # 8-bit: the W8 kernel up to 64 tokens, against cuBLAS on the dense weight at every count
    assert quant_points(1, bits=8) == ["w8_gemm", "cublas"]
    assert quant_points(64, bits=8) == ["w8_gemm", "dense", "cublas"]
    assert quant_points(65, bits=8) == ["dense", "cublas"]
    assert quant_points(257) == ["dense", "cublas"]


def test_a_products_floor_is_its_weight_stream_or_its_math_whichever_is_longer():
    # 2048 x 22016 W4 G128: 22.5 MB packed + 1.4 MB of scales and zeros
    weight_bytes = 22016 * 2048 // 2 + 2 * 22016 * 16 * 2
    # 16 tokens: 23.95 MB at 4000 GB/s = 5.988 us against 1.44 GFLOP at 800 TFLOP/s = 1.80 us
    assert abs(product_floor_us(16, 2048, 22016, weight_bytes, 4000.0, 800.0) - 5.988352) < 1e-6
    # 256 tokens: the math (28.9 us) is longer
    assert abs(product_floor_us(256, 2048, 22016, weight_bytes, 4000.0, 800.0) - 2 * 256 * 2048 * 22016 / 800e6) < 1e-9


def test_bench_gemv_rows_show_the_kernel_its_launch_and_the_share_of_the_floor():
    from rich.console import Console

    base = {"in_features": 2048, "out_features": 22016, "bits": 4, "tokens": 64, "dtype": "bfloat16", "us_std": 0.1,
            "gbps": 1000.0, "fraction_of_copy": 0.25, "floor_us": 7.1}
    rows = [base | {"kernel": "w4_gemm", "tile": "wgmma<2,1,64,4>/splits=2", "auto": True, "us_mean": 28.4,
                    "fraction_of_floor": 0.25},
            base | {"kernel": "cublas", "tile": "-", "auto": False, "us_mean": 27.0, "fraction_of_floor": 0.263},
            base | {"kernel": "dense", "tile": 0, "auto": False, "us_mean": 61.7, "fraction_of_floor": None}]
    checks = {"w4_batch1_bandwidth": [], "w4_batch16_cost": [], "decode_attention_bandwidth": []}
    payload = {"copy_bandwidth": {"gbps_mean": 4252.0, "gbps_std": 8.0}, "matmul_tflops": 800.0, "quant_matmul": rows,
               "bandwidth_checks": checks, "paged_attention": []}
    console = Console(record=True, width=200)
    for table in gemv_tables(payload):
        console.print(table)
    text = console.export_text()
    assert "bfloat16 activations" in text and "cuBLAS 800 TFLOP/s" in text
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if "2048x22016" in line]
    assert [(row[3], row[-1]) for row in cells] == [("w4_gemm/wgmma<2,1,64,4>/splits=2", "25"),
                                                    ("cublas (peer)", "26"), ("dense (alt)", "-")]


def test_bench_gemv_attention_rows_name_their_path():
    """The attention table says which path a row timed: the combined or clustered kernel (one split, no reduce) or
    the split path with its split count; rows without a path show their split count."""
    from rich.console import Console

    row = {"batch": 64, "context": 1024, "heads": 16, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16",
           "kv": "same", "pipelined": True, "splits": 1, "us_mean": 10.0, "us_std": 0.1, "gbps": 3000.0,
           "fraction_of_copy": 0.7, "torch_us_mean": None, "speedup_vs_torch": None}
    checks = {"w4_batch1_bandwidth": [], "w4_batch16_cost": [], "decode_attention_bandwidth": []}
    payload = {"copy_bandwidth": {"gbps_mean": 4252.0, "gbps_std": 8.0}, "quant_matmul": [], "bandwidth_checks": checks,
               "paged_attention": [row | {"path": "combined"}, row | {"batch": 1, "path": "split", "splits": 32},
                                   row | {"batch": 2, "splits": 16}, row | {"batch": 4, "path": "clustered"}]}
    console = Console(record=True, width=200)
    for table in gemv_tables(payload):
        console.print(table)
    lines = [line for line in console.export_text().splitlines() if "16/2x128" in line]
    assert len(lines) == 4
    assert "combined" in lines[0] and "split 32" in lines[1] and "split 16" in lines[2] and "clustered" in lines[3]


def test_bandwidth_checks_hold_each_dispatched_point_to_its_bar():
    """Only dispatched ("auto") W4 points count: one token on shapes of at least 4096x4096 against 70% of copy
    bandwidth, 16 tokens against 1.5x one token's time; attention at 16 sequences and 4k+ contexts against 60%."""
    def point(k, n, tokens, us, fraction, auto=True, bits=4):
        return {"auto": auto, "bits": bits, "in_features": k, "out_features": n, "tokens": tokens, "us_mean": us,
                "fraction_of_copy": fraction}

    quant = [point(4096, 4096, 1, 10.0, 0.72), point(4096, 4096, 16, 16.0, 0.5),
             point(2048, 2048, 1, 4.0, 0.15), point(2048, 2048, 16, 5.0, 0.4),
             point(4096, 4096, 1, 20.0, 0.3, auto=False), point(4096, 4096, 1, 9.0, 0.6, bits=3)]
    attention = [{"batch": b, "context": c, "kv": "same", "heads": 32, "kv_heads": 8, "head_dim": 128,
                  "fraction_of_copy": f, "default_variant": d}
                 for b, c, f, d in ((16, 4096, 0.79, True), (16, 16384, 0.55, True), (16, 2048, 0.1, True),
                                    (4, 4096, 0.2, True), (16, 4096, 0.1, False))]
    checks = bandwidth_checks(quant, attention)
    assert checks["w4_batch1_bandwidth"] == [{"shape": "4096x4096", "fraction_of_copy": 0.72, "passes": True}]
    assert checks["w4_batch16_cost"] == [{"shape": "4096x4096", "batch16_over_batch1": 1.6, "passes": False},
                                         {"shape": "2048x2048", "batch16_over_batch1": 1.25, "passes": True}]
    assert [(row["context"], row["passes"]) for row in checks["decode_attention_bandwidth"]] == [(4096, True),
                                                                                                 (16384, False)]
