"""The checked-in generated modules match proto/pdserve.proto (regenerate with `make proto`)."""

from pathlib import Path

from pdserve.proto.generate import OUTPUTS, PROTO_DIR, generate


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    for name in OUTPUTS:
        assert (PROTO_DIR / name).read_text() == fresh[name], f"{name} is stale: run `make proto`"


def test_generated_modules_import_as_pdserve_proto() -> None:
    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    assert hasattr(pdserve_pb2_grpc, "RouterStub") and hasattr(pdserve_pb2_grpc, "WorkerStub")
    req = pdserve_pb2.GenerateRequest(text="hi", sampling=pdserve_pb2.SamplingParams(seed=1))
    assert req.sampling.HasField("seed") and not req.sampling.HasField("temperature")
