"""A real worker process built on `workers.runtime` that misbehaves on command.

The tests use it to inject REAL faults into the host: real signals, real aborts, real bytes
on the socket. Nothing is simulated on the host side.

Startup faults come from argv `--fault NAME` (they happen before or during the handshake):
    wrong_nonce, v2, exit_after_hello, no_hello, early_progress, crash_on_start

Request faults come from the `model_ref` of a request, `fault:NAME[:ARG[:ARG]]`:
    hang              one valid PROGRESS (inference), then silence forever
    hang_setup        one valid PROGRESS (setup), then silence forever
    sigstop           one valid PROGRESS, then SIGSTOP itself
    slow:N:SECS       N valid PROGRESS frames SECS apart, then a normal reply
    late:SECS         sleep SECS without progress, then a normal reply
    sigkill           print a last words line, then SIGKILL itself
    abort             print a last words line, then os.abort()
    bug               raise a plain exception (runtime exits 70 with a traceback)
    error:CODE        answer ERR CODE
    garbage           a frame that is not JSON
    oversize          a frame header above max_frame
    progress_regress  PROGRESS completed 2 then 1
    phase_regress     PROGRESS inference then setup
    progress_between  VECTORS header, PROGRESS, then the raw frame
    short_raw         VECTORS header whose raw frame is 4 bytes short
    wrong_req_id      a reply carrying another req_id
    spam:BYTES        write BYTES of log lines to stderr, then a normal reply
    echo              one item; reply n=1, dims=n_tokens with the ids' bytes as f32 (bench)

Any other model_ref answers normally: item vector = [sum(ids), n_tokens, first id, item id].
A LOAD whose runtime_config names `"fault": "sigstop_first_ping"` loads normally, then the
worker SIGSTOPs itself on the next PING, before its PONG (a first PING held for as long as the
test says). Its LOAD may name `n_vocab` in runtime_config: then an EMBED_BATCH with an id outside
0..n_vocab-1 is refused with ERR invalid_request, as a real engine refuses one.
"""
