"""TorchRec's quantized comms in the benchmark: the codec pairs its entries run with.

A pair is named ``"<forward>/<backward>"`` as TorchRec's ``CommType`` values (``fp16/bf16``); an
entry records its pair in ``params["qcomms"]`` (none: fp32 both ways). The same registry goes to
stock sharders and to the plugin's, so a plugin entry and a stock entry with the same pair ran
under the same codecs.

Precisions on CPU (FBGEMM's CPU codecs over gloo): see docs/measuring.md#quantized-comms.
"""

from torchrec_het_testing.settings import qcomms_registry as registry  # noqa: F401 (the entries' registry, as a user builds it)

FP16 = "fp16/bf16"  # what a TorchRec user turns on first: fp16 forward, bf16 backward
INT8 = "int8/int8"  # row-wise: 32 values a row, with an fp32 scale and bias
MX4 = "mx4/mx4"  # 4-bit values, a shared exponent per 32
PAIRS = (FP16, INT8, MX4)


def suffix(pair: str) -> str:
    """An entry name's suffix for ``pair``: ``_fp16`` for fp16/bf16, ``_int8`` for int8/int8."""
    return "_" + pair.split("/")[0]


def of(entry: dict) -> str | None:
    """The codec pair an entry of results.json ran with (None: fp32)."""
    return (entry.get("params") or {}).get("qcomms")
