"""Where paratune's activation checkpoint sits in a block, under whichever transformers is importable.

Run as a script (tests/test_recompute_compile.py runs it with the dev venv's transformers and with
the GPU image's, .venv/gpu-image-site): prints one JSON line with
- the transformers version it ran under;
- `hook_calls`: a forward pre-hook on a checkpointed block, per forward + backward (1: module hooks
  such as FSDP2's stay outside the recompute; 2: the hook ran again in the recompute);
- `mlp_calls`: the block's MLP forward per forward + backward (2: the block was recomputed);
- `graph_has_checkpoint`: a compiled selective block's Dynamo graph holds the checkpoint
  (`tag_activation_checkpoint`), i.e. the compiler applies selective checkpointing's policy rather
  than the policy's dispatch modes running around an opaque compiled region.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

import torch  # noqa: E402
import transformers  # noqa: E402

from paratune.model.build import build_config, build_model, decoder_blocks  # noqa: E402
from paratune.parallel.recompute import checkpoint_blocks  # noqa: E402


def _model(mode: str):
    config = build_config("tiny-llama", {"num_hidden_layers": 2})
    model = build_model(config, seed=0)
    model.train()
    checkpoint_blocks(model, mode)
    return config, model


def hook_and_recompute_counts() -> dict[str, int]:
    config, model = _model("full")
    block = decoder_blocks(model)[0]
    calls = {"hook": 0, "mlp": 0}
    block.register_forward_pre_hook(lambda *_: calls.__setitem__("hook", calls["hook"] + 1))
    block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return {"hook_calls": calls["hook"], "mlp_calls": calls["mlp"]}


def compiled_graph_has_checkpoint() -> bool:
    config, model = _model("selective")
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001 - Dynamo's backend signature
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for block in decoder_blocks(model):
        block.compile(backend=capture, dynamic=False)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return any("tag_activation_checkpoint" in str(node.target) for gm in graphs for node in gm.graph.nodes)


if __name__ == "__main__":
    print(json.dumps({"transformers": transformers.__version__, **hook_and_recompute_counts(),
                      "graph_has_checkpoint": compiled_graph_has_checkpoint()}))
