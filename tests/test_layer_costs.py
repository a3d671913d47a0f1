"""measure/layer_costs.py: its pass with nothing left out is the engine's decoder layer (same
float32 logits, so the parts it times are the real layer's), each part left out changes the
answer, and `products_of` runs every product of the pass."""

from __future__ import annotations

import pytest
import torch

from engine import fast_decode
from engine.runner import Runner
from measure import layer_costs


@pytest.fixture
def runner(zoo):
    target = zoo.target("qwen2_vl")
    runner = Runner(target.model, target.family)
    runner.fast.stack.native = None  # the Python layer, which the tool's variants replace
    return runner


def logits_with(runner, layer_fn) -> torch.Tensor:
    """Logits of two decode passes after a 6-token prompt, with `layer_fn` as the decoder layer."""
    ids = torch.tensor([[5, 9, 13, 7, 21, 4]])
    runner.fast.stack.layer_fn = layer_fn  # this runner's stack only: nothing global is patched
    with torch.inference_mode():
        _, state = runner.prefill({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return torch.cat([runner.extend(state, [7]), runner.extend(state, [11])])


def test_nothing_left_out_is_the_engines_layer_and_each_part_matters(runner, one_thread):
    engine_logits = logits_with(runner, fast_decode.decoder_layer)
    torch.testing.assert_close(logits_with(runner, layer_costs.layer_without(set())), engine_logits,
                               atol=1e-6, rtol=0)
    for part in layer_costs.PARTS:
        without = logits_with(runner, layer_costs.layer_without({part}))  # unwritten cache slots: any values
        assert not torch.allclose(without, engine_logits, atol=1e-4, rtol=0), part


def test_products_of_runs_every_product_of_the_pass(runner, monkeypatch):
    calls = []
    real = fast_decode.linear
    monkeypatch.setattr(layer_costs, "linear", lambda x, weight, bias=None: calls.append(weight) or real(x, weight, bias))
    layer_costs.products_of(runner.fast)()
    layers = runner.fast.stack.layers
    assert len(calls) == 4 * len(layers) + 1 and calls[-1] is runner.fast.head_weight
    assert all(any(w is c for c in calls) for layer in layers
               for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight))

