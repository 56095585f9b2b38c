

def test_a_ranks_blocks_are_traced_as_moe_blocks_with_its_own_experts():
    """The activation trace under ep holds E / ep experts (at least top_k) and MoE blocks only."""
    import json

    from paratune.activations import _rank_experts
    from paratune.shapes import model_config_key

    key = model_config_key(_plan())
    assert _rank_experts(key, 1) == key  # all experts, no dense first blocks to skip
    assert json.loads(_rank_experts(key, 4))["num_local_experts"] == EXPERTS // 4
    deepseek = json.loads(_rank_experts(model_config_key(_plan(model="deepseek-v3", num_workers=64, ep=64)), 64))
    assert (deepseek["n_routed_experts"], deepseek["first_k_dense_replace"], deepseek["n_group"]) == (8, 0, 1)
    dense = model_config_key(_plan(model="tiny-llama", ep=1))
    assert _rank_experts(dense, 4) == dense
