"""Certification: a real lane, driven through the host, judged against an independent fp32
reference, with ANE placement gated alongside (a Core ML lane that falls back to the CPU
is not the lane it claims to be, however close its vectors).

    runner        one run: load, corpus pass, retrieval, probe fingerprint, placement, verdict
    lane_client   what a certification run asks of a Module's lane (llama and Core ML)
    lane_policy   which lane serves a model by default, from the certificates
    modules       build_module: the Module every entry point serves with, policy given
    oracle        reference directory, its own tokenization, which fp32 forward judges
                  (sentence-transformers where installed, else numpy BERT), its cache
    gates         checks and the verdict (pure functions)
    thresholds    THE gate table, per lane and precision, with reasons
    fingerprint   margin-masked quantized digest of the probe-set outputs
    identity      lane identity and the certificate key
    certificate   the JSON record (msgspec); store: certificates on disk
    policy        require_certificate strict|warn|off, CertificateRequired
    placement_ops per-op placement estimate of the admitted Core ML packages (report)
    report, svg   the HTML report with inline SVG plots; terminal: rich output; cli
    shapes        the `8x128,4x256p` spelling of compiled shapes
    degrade       deliberately degraded checkpoints (prove the gate bites)
    corpus, reference/  the fixed corpus and the reference forwards themselves (bert: numpy;
                  st_model: sentence-transformers / transformers, fp32 CPU)
"""
