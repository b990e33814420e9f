"""Real receivers for the notification tests, on loopback.

    sinks.py smtp PORT FILE      an SMTP server (aiosmtpd): each mail received
                                 is appended to FILE as one JSON line
    sinks.py http PORT FILE      an HTTP server: each POST's body is appended
                                 to FILE as one line, answered 200
    sinks.py hang PORT FILE      an HTTP server that never answers a POST
    sinks.py flaky PORT FILE     as http, but the first two POSTs get 503
    sinks.py reject PORT FILE    as http, but every POST gets 400

Each prints "ready" on stdout once it listens.
"""
import email
import email.policy
import http.server
import json
import sys
import time


def append(path, line):
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def smtp(port, path):
    from aiosmtpd.controller import Controller

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            msg = email.message_from_bytes(envelope.original_content, policy=email.policy.default)
            append(path, json.dumps({
                "mail_from": envelope.mail_from,
                "rcpt_tos": envelope.rcpt_tos,
                "from": str(msg["from"]),
                "to": str(msg["to"]),
                "cc": str(msg["cc"] or ""),
                "subject": str(msg["subject"]),
                "content_type": msg.get_content_type(),
                "body": msg.get_content(),
            }))
            return "250 OK"

    controller = Controller(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def web(port, path, kind):
    posts = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if kind == "hang":
                time.sleep(3600)
            posts[0] += 1
            status = 200
            if kind == "reject" or (kind == "flaky" and posts[0] <= 2):
                status = 400 if kind == "reject" else 503
            append(path, json.dumps({
                "path": self.path,
                "status": status,
                "at": time.monotonic(),
                "content_type": self.headers.get("Content-Type"),
                "body": body.decode("utf-8", "replace"),
            }))
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    kind, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if kind == "smtp":
        smtp(port, path)
    else:
        web(port, path, kind)
