"""`MoEConfig`: every option of an MoE layer, typed, validated once, translated from DeepSpeed.

DeepSpeed configures MoE through the arguments of `deepspeed.moe.layer.MoE(...)` (`num_experts`,
`ep_size`, `k`, `capacity_factor`, ...); `MoEConfig.from_section` takes a dict with those keys
(a `"moe"` section, path `moe`) and gives our names, which say their unit or meaning. Each field
names the DeepSpeed argument it reads (the config pattern, `minispeed.core.sections`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from minispeed.core.config import ConfigError, field_error, join_path
from minispeed.core.sections import Section, Unsupported, build, ds_only, key, translate_section

__all__ = ["AUX_LOSS_CHOICES", "DROP_ORDERS", "NOISY_GATE_POLICIES", "WEIGHTS_OVER", "MoEConfig"]

NOISY_GATE_POLICIES = (None, "jitter", "rsample")
DROP_ORDERS = ("choice", "probability")
WEIGHTS_OVER = ("chosen", "kept")
AUX_LOSS_CHOICES = ("first", "all")


def _noisy_gate_policy(value: Any) -> str | None:
    """DeepSpeed's `"Jitter"` / `"RSample"` / `"None"` -> `"jitter"` / `"rsample"` / None."""
    return None if value in (None, "None", "none") else str(value).lower()


@dataclasses.dataclass(frozen=True)
class MoEConfig(Section):
    """How one MoE layer routes tokens, how many experts it has, and how they are spread."""

    ds_path: ClassVar[str] = "moe"
    # Keys DeepSpeed accepts whose features minispeed does not have: refused unless off.
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "use_residual": ds_only(False, "Residual MoE (PR-MoE) is not implemented"),
        "use_tutel": ds_only(
            False, "Tutel kernels are not used; the permutation op plays their part"
        ),
        "enable_expert_tensor_parallelism": ds_only(False, "experts are not tensor-parallel here"),
    }

    num_experts: int = key("num_experts")
    """Experts per layer, E (all ranks together)."""
    expert_parallel_degree: int = key("ep_size", 1)
    """E_p: ranks an expert-parallel group spans; each holds E / E_p experts. Must divide E and
    the world size. DeepSpeed's `ep_size`."""
    top_k: int = key("k", 1)
    """Experts each token is sent to, k (1: Switch, 2: GShard). DeepSpeed's `k`."""
    capacity_factor: float = key("capacity_factor", 1.0)
    """Training capacity: each expert takes at most C = ceil(k·S/E · factor) assignments of a
    rank's S tokens (see `capacity`); > 0. `math.inf`: no limit (C = S, nothing dropped)."""
    eval_capacity_factor: float = key("eval_capacity_factor", 1.0)
    """The same factor in eval mode (`module.eval()`); > 0, or `math.inf`."""
    min_capacity: int = key("min_capacity", 4)
    """C is at least this (small batches would otherwise drop most tokens); >= 0."""
    drop_tokens: bool = key("drop_tokens", True)
    """True: assignments past an expert's capacity are dropped (fixed-size buffers, equal-split
    all-to-all). False: every assignment is kept (buffers sized by the counts, uneven splits)."""
    noisy_gate_policy: str | None = key(
        "noisy_gate_policy",
        None,
        read=_noisy_gate_policy,
        schema={"enum": ["Jitter", "RSample", "None", None]},
    )
    """Training-time noise: `"jitter"` multiplies the gate input by U(1-ε, 1+ε), ε = 0.01;
    `"rsample"` picks the top-1 expert from logits + Gumbel noise (weights stay the clean
    softmax). None: no noise. DeepSpeed's `"Jitter"`, `"RSample"`."""
    random_token_selection: bool = key(
        "use_rts", True, derived="Left out: true at k = 1, off at other k (as DeepSpeed's gate)."
    )
    """When dropping with `drop_order="choice"`, the order of tokens inside a choice: True, a
    random order (no bias toward early tokens); False, token order. Training only; eval keeps
    token order. DeepSpeed's `use_rts` (which acts at k = 1 only there)."""
    drop_order: str = "choice"
    """Which assignments an over-full expert keeps. `"choice"` (GShard): every token's first
    choice before any second choice, tokens in order (or at random, see
    `random_token_selection`) inside a choice. `"probability"`: the assignments with the highest
    router probability (DeepSpeed's top-k gate for k >= 3); needs
    `random_token_selection=False`."""
    weights_over: str = "chosen"
    """k > 1: the gate weights are the probabilities renormalized over a token's `"chosen"` k
    experts (GShard: a dropped choice keeps its share, the token's output shrinks) or over its
    `"kept"` ones (DeepSpeed: the surviving choices share weight 1)."""
    aux_loss_choices: str = "first"
    """Which choices count in the load-balancing loss: `"first"` (Switch/GShard: f_e is the
    fraction of first choices) or `"all"` (DeepSpeed's top-k gate for k >= 3: f_e counts all k
    choices and the loss is divided by k); see `load_balancing_loss`."""
    second_expert_sampling: bool = key(
        "top2_2nd_expert_sampling",
        False,
        derived="Left out: true at k = 2, off at other k (as DeepSpeed's gate).",
    )
    """Training only, k > 1: choices after the first are picked from logits + Gumbel noise
    (exploration), not greedily. DeepSpeed's `top2_2nd_expert_sampling` (default True there)."""
    aux_loss_coef: float = key("aux_loss_coef", 0.01, aliases=("moe_loss_coeff",))
    """Weight of the load-balancing loss in `MoE.loss` (Switch: 0.01). >= 0."""
    z_loss_coef: float = key("z_loss_coef", 0.0)
    """Weight of the router z-loss mean(logsumexp(logits)²) in `MoE.loss` (ST-MoE: 0.001). >= 0."""

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise field_error(self, name, f"must be an int >= {minimum}, got {value!r}")

        positive_int("num_experts", self.num_experts)
        positive_int("expert_parallel_degree", self.expert_parallel_degree)
        positive_int("top_k", self.top_k)
        positive_int("min_capacity", self.min_capacity, minimum=0)
        if self.num_experts % self.expert_parallel_degree:
            raise field_error(
                self,
                "expert_parallel_degree",
                f"num_experts={self.num_experts} is not divisible by "
                f"expert_parallel_degree={self.expert_parallel_degree}; every rank of an "
                "expert-parallel group holds E / E_p experts, so pick E_p among the divisors of "
                f"{self.num_experts}: {[d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]}",
            )
        if self.top_k > self.num_experts:
            raise field_error(
                self,
                "top_k",
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; a token "
                "goes to k distinct experts, so use top_k <= num_experts",
            )
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise field_error(
                    self,
                    name,
                    f"must be > 0, got {value!r}; 1.0 gives each expert its "
                    "fair share k·S/E, larger values drop fewer tokens (use drop_tokens=False "
                    "to drop none)",
                )
        if self.noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise field_error(
                self,
                "noisy_gate_policy",
                f"must be one of {list(NOISY_GATE_POLICIES)}, got {self.noisy_gate_policy!r}",
            )
        for name, allowed in (
            ("drop_order", DROP_ORDERS),
            ("weights_over", WEIGHTS_OVER),
            ("aux_loss_choices", AUX_LOSS_CHOICES),
        ):
            if getattr(self, name) not in allowed:
                raise field_error(
                    self, name, f"must be one of {list(allowed)}, got {getattr(self, name)!r}"
                )
        if self.drop_order == "probability" and self.random_token_selection:
            raise field_error(
                self,
                "drop_order",
                "drop_order='probability' ranks assignments by router probability, so "
                "random_token_selection=True has nothing to act on; set "
                "random_token_selection=False",
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise field_error(self, name, f"must be >= 0, got {getattr(self, name)!r}")
        super().__post_init__()

    @property
    def num_local_experts(self) -> int:
        """Experts each rank holds: E / E_p."""
        return self.num_experts // self.expert_parallel_degree

    @classmethod
    def from_section(
        cls, section: Mapping[str, Any] | None = None, *, path: str | None = None
    ) -> MoEConfig:
        """Translate DeepSpeed's MoE arguments (`deepspeed.moe.layer.MoE`) into a config.

        `{"num_experts": 8, "ep_size": 2, "k": 1, "noisy_gate_policy": "RSample"}` ->
        `MoEConfig(num_experts=8, expert_parallel_degree=2, top_k=1, noisy_gate_policy="rsample",
        weights_over="kept", ...)`. DeepSpeed's defaults apply to absent keys. Unknown keys, and
        `use_residual`, `use_tutel`, `enable_expert_tensor_parallelism` set to True, raise
        naming the key.

        DeepSpeed's gate has one routine per k, and the config follows each, so the layer routes
        as DeepSpeed 0.19.8's `TopKGate` does (the `test_gate_deepspeed_parity` fixtures):

        - the surviving choices share weight 1 (`weights_over="kept"`);
        - `use_rts` acts at k = 1 only, `top2_2nd_expert_sampling` (default True) at k = 2 only,
          `noisy_gate_policy="RSample"` at k = 1 only (`"Jitter"` at every k); elsewhere
          DeepSpeed ignores them, and so they are off here;
        - k >= 3: an over-full expert keeps its highest-probability assignments
          (`drop_order="probability"`) and the aux loss counts all k choices
          (`aux_loss_choices="all"`).
        """
        path = cls.ds_path if path is None else path
        kwargs: dict[str, Any] = {"weights_over": "kept", **translate_section(cls, section, path)}
        if "num_experts" not in kwargs:
            raise ConfigError(
                join_path(path, "num_experts"), "required: 'num_experts' (experts per MoE layer)"
            )
        k = kwargs.get("top_k", 1)
        # Where DeepSpeed's routine for this k ignores an option, it is off here too.
        kwargs["random_token_selection"] = k == 1 and kwargs.get("random_token_selection", True)
        kwargs["second_expert_sampling"] = k == 2 and kwargs.get("second_expert_sampling", True)
        if k != 1 and kwargs.get("noisy_gate_policy") == "rsample":
            kwargs["noisy_gate_policy"] = None
        if isinstance(k, int) and k >= 3:
            kwargs.update(drop_order="probability", aux_loss_choices="all")
        return build(cls, path, kwargs, section)
