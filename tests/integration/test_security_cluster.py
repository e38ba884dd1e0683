"""API keys, the cluster secret and TLS on a real cluster (router + workers as processes)."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from test_faults_procs import post, procs  # noqa: F401 (fixture)

from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

SECRET = "cluster-s3cret"
KEY = "client-key"


def _tls_files(tmp_path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


def test_keys_secret_and_tls(procs, tmp_path):
    cert, key = _tls_files(tmp_path)
    tls = ("--tls-cert", cert, "--tls-key", key, "--tls-ca", cert)
    procs.start_router("--api-key", KEY, "--registration-secret", SECRET, *tls)
    prefill, decode = procs.start_workers("prefill", "decode",
                                          args=("--registration-secret", SECRET, *tls))
    procs.wait_healthy(2)  # registered over TLS with the secret; health-checked over TLS
    url = f"{procs.url}/v1/completions"
    status, body = post(url, {"prompt": "hi", "max_tokens": 2})
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body

    async def grpc_checks() -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        async with grpc.aio.secure_channel(procs.grpc_addr, creds) as ch:
            router = pb_grpc.RouterStub(ch)
            req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=3))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in router.Generate(req, timeout=60):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = [m async for m in router.Generate(
                req, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),))]
            assert out and out[-1].finish_reason
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await router.RegisterWorker(pb.RegisterWorkerRequest(
                    worker=pb.WorkerInfo(role="decode", address="127.0.0.1:1"), secret="no"))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with grpc.aio.secure_channel(decode.fields["grpc"], creds) as ch:
            worker = pb_grpc.WorkerStub(ch)
            for call in (worker.Abort(pb.AbortRequest(room=1)),
                         worker.Status(pb.StatusRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "secret" in (e.value.details() or "")
            ok = await worker.Status(pb.StatusRequest(),
                                     metadata=(("x-pdserve-secret", SECRET),))
            assert ok.info.role == "decode"
        async with grpc.aio.insecure_channel(prefill.fields["grpc"]) as ch:  # plaintext: refused
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.WorkerStub(ch).Status(pb.StatusRequest(), timeout=5)

    asyncio.run(grpc_checks())
    import urllib.request

    req = urllib.request.Request(url, data=b'{"prompt": "hi", "max_tokens": 2}', headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
    procs.wait_idle(60)


def test_servers_bind_loopback_by_default(procs):
    procs.start_router()
    prefill, decode = procs.start_workers("prefill", "decode")
    for addr in (procs.grpc_addr, procs.url.removeprefix("http://"), prefill.fields["grpc"],
                 prefill.fields["bootstrap"], decode.fields["grpc"]):
        assert addr.startswith("127.0.0.1:"), addr
