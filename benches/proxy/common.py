"""What the proxy benchmarks share: the test tokenizer's path, the instant upstream (nginx answering
a fixed chat completion) and a `kvroute serve --proxy` configuration in front of it."""
import os, sys, time, urllib.request

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../.."

# The fixed answer: a small chat completion with its usage, as an engine would send it.
ANSWER = ('{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
          '"message":{"role":"assistant","content":"Hello there, this is a fixed answer."},'
          '"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":8,'
          '"total_tokens":18}}')


def tokenizer():
    """The test tokenizer's tokenizer.json (written by the tokenize bench), or exit saying how to
    make it."""
    tok = os.path.join(os.environ.get("KVROUTE_TOKENIZE_BENCH_DIR", "/tmp/kvroute-tokenize-bench"),
                       "tokenizer.json")
    if not os.path.exists(tok):
        sys.exit(f"{tok} is missing: cargo bench -p kvroute-tokenize --bench encode -- --test")
    return tok


def prose_words():
    return open(f"{ROOT}/host/tokenize/testdata/prose.txt").read().split()


def write_upstream_conf(path, work, port, answer=ANSWER, connections=1024):
    """An nginx configuration (one worker, in the foreground) answering `answer` to everything."""
    open(path, "w").write(f"""worker_processes 1; daemon off; pid {work}/up.pid; error_log {work}/up.err;
events {{ worker_connections {connections}; }}
http {{ access_log off; server {{ listen 127.0.0.1:{port}; keepalive_requests 1000000;
  location / {{ default_type application/json; return 200 '{answer}'; }} }} }}
""")


def write_kvroute_toml(path, port, upstream, tok, extra=""):
    """`kvroute serve` with one HTTP thread, the proxy on, model `m` on one engine at `upstream`."""
    open(path, "w").write(f"""listen = "127.0.0.1:{port}"
http_threads = 1
[proxy]
enabled = true
[models.m]
tokenizer = "{tok}"
[workers.1]
endpoint = "http://127.0.0.1:{upstream}"
model = "m"
{extra}""")


async def read_answer(r):
    """Reads one HTTP/1.1 answer from the stream reader `r` (a length or chunked body); returns its
    status code as bytes."""
    head = await r.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    if length:
        await r.readexactly(length)
    elif b"chunked" in head.lower():  # read to the terminating chunk
        while not (await r.readuntil(b"\r\n")) == b"0\r\n":
            pass
        await r.readuntil(b"\r\n")
    return head.split(b" ", 2)[1]


def wait_ready(port, seconds=10.0, pause=0.1):
    """Waits until kvroute on `port` answers /healthz, or exits saying it did not start."""
    for _ in range(int(seconds / pause)):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(pause)
    sys.exit(f"kvroute on port {port} did not start")


def threads(pid):
    """CPU time so far of each thread of process `pid`: {tid: (name, nanoseconds)}, from
    /proc/PID/task/*/schedstat (threads that end meanwhile are left out)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            ns = int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except OSError:
            continue
        out[tid] = (name, ns)
    return out
