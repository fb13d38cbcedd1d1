"""A raw-socket HTTP server on loopback for the client's hostile cases: each connection's request is read,
then `answer(sock, request_bytes)` writes whatever bytes (or none, or slowly) it likes."""

import socket
import threading


class RawServer:
    def __init__(self, answer, host="127.0.0.1"):
        self.answer, self.requests = answer, []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.stopped = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + rest)
            self.answer(conn, head)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stopped.set()
        self.sock.close()


def json_answer(body: bytes, status: str = "200 OK", extra: str = ""):
    def answer(conn, request):
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
                     "Connection: close\r\n\r\n".encode() + body)
    return answer
