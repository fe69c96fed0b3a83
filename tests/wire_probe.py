"""Runs inside an emulated host (tests/test_netns_wire.py): a TCP echo / UDP counter and their clients.

    python wire_probe.py tcp-server ADDR PORT READY      echo 8-byte messages until the peer closes
    python wire_probe.py tcp-client ADDR PORT N          print the median round trip of N echoes (ms)
    python wire_probe.py udp-server ADDR PORT READY N    print JSON: datagrams received, out of order
    python wire_probe.py udp-client ADDR PORT N          send N numbered datagrams, 0.2 ms apart
"""
import json
import socket
import statistics
import struct
import sys
import time


def main(role: str, addr: str, port: str, arg: str, count: str = "0") -> None:
    if role == "tcp-server":
        s = socket.create_server((addr, int(port)))
        open(arg, "w").close()
        c, _ = s.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            data = c.recv(8)
            if not data:
                return
            c.sendall(data)
    elif role == "tcp-client":
        c = socket.create_connection((addr, int(port)), timeout=30)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(int(arg)):
            t = time.perf_counter()
            c.sendall(b"x" * 8)
            got = b""
            while len(got) < 8:
                got += c.recv(8 - len(got))
            rtts.append(time.perf_counter() - t)
        print(statistics.median(rtts) * 1e3)
    elif role == "udp-server":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((addr, int(port)))
        s.settimeout(3.0)
        open(arg, "w").close()
        seen, late, top = 0, 0, -1
        try:
            while seen < int(count):
                (k,) = struct.unpack("<I", s.recv(64)[:4])
                seen += 1
                late += k < top
                top = max(top, k)
        except socket.timeout:  # the rest were dropped
            pass
        print(json.dumps({"received": seen, "out_of_order": late}))
    elif role == "udp-client":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for k in range(int(arg)):
            s.sendto(struct.pack("<I", k) + b"." * 28, (addr, int(port)))
            time.sleep(0.0002)


if __name__ == "__main__":
    main(*sys.argv[1:])
