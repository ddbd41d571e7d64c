"""HfcpGRPOTrainer: TRL's GRPOTrainer with context parallelism, generating with the policy's own generate()
(trl is the optional extra `hfcp[trl]`).

What changes against GRPOTrainer, and why:
- generation: the policy's generate() under CP (the prompt's KV cache spread over the CP group); every rank of a CP
  group gets the same prompts and is seeded with seed + its DP rank (TRL: seed + process index), so the ranks draw
  the same tokens, and a CP group draws what one process of TRL's with that DP index draws;
- batch sizes: GRPOConfig derives the generation batch from the number of processes; here it is per DP group
  (per_device_train_batch_size x DP groups x steps_per_generation);
- rewards: computed by the first rank of each CP group alone and shared with the group (a reward model or an
  external judge runs once per group, and every rank gets the same rewards);
- per-token log-probabilities of the policy, the old policy and the reference: hfcp.sequence_logps on each rank's
  tokens, made whole per completion token (completion_logps.py); the loss is then TRL's own on whole tensors;
- TRL's gathers, reductions and process index count each DP group once (dp_view.py).
"""
from __future__ import annotations

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("hfcp.integrations.HfcpGRPOTrainer needs TRL: "
                      "pip install 'hfcp[trl]' (or pip install trl)") from e

import dataclasses
import inspect
import logging

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from transformers import ProcessorMixin

from ..api import patch
from ..state import cp_state
from .completion_logps import completion_logps
from .dp_view import data_parallel_view, gathers_kept_local
from .trainer import UNSET, HfcpTrainerMixin

# every loss type of TRL 1.16, each verified against GRPOTrainer in one process
# (tests/integrations/test_grpo_trainer.py)
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
_TRL_MODULE = GRPOTrainer.__module__  # where GRPOTrainer's gather / gather_object are looked up
log = logging.getLogger("hfcp")


def settings_problems(args, given: dict) -> list[str]:
    """What HfcpGRPOTrainer refuses in its arguments, before GRPOTrainer's __init__ starts anything (vLLM, say)."""
    problems = []
    if args.use_vllm:
        problems.append("use_vllm=True (vLLM generates with its own engine and KV cache, which hfcp does not spread "
                        "over the CP group, so each rank's engine would hold the whole prompt; set use_vllm=False: the "
                        "completions then come from the policy's generate() with its KV cache spread over the group)")
    if args.use_transformers_continuous_batching:
        problems.append("use_transformers_continuous_batching=True (its paged cache is not hfcp's cache spread over "
                        "the CP group; leave it off)")
    for name in ("tools", "environment_factory", "rollout_func"):
        if given.get(name):
            problems.append(f"{name} (multi-turn rollouts are not verified under CP yet; train single-turn)")
    if isinstance(given.get("processing_class"), ProcessorMixin):
        problems.append("a processor (a vision-language model: hfcp.sequence_logps takes text-only causal LMs)")
    if args.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={args.loss_type!r} (not verified under CP yet; use one of {list(LOSS_TYPES)})")
    if args.cast_lm_head_to_fp32:
        problems.append("cast_lm_head_to_fp32=True (hfcp computes the log-probabilities through the head as it is)")
    if args.use_liger_kernel:
        problems.append("use_liger_kernel=True (its kernels replace modules hfcp runs under CP; not verified)")
    if args.entropy_coef or args.use_adaptive_entropy:
        problems.append(f"entropy_coef={args.entropy_coef} / use_adaptive_entropy={args.use_adaptive_entropy} (the "
                        "entropy bonus needs the entropy's gradient; "
                        "hfcp computes the entropy as a metric, without one)")
    if args.ddp_find_unused_parameters:
        problems.append("ddp_find_unused_parameters=True (DDP would mark the output head unused when the forward "
                        "returns: hfcp runs the head after it, chunk by chunk; leave it unset)")
    if args.deepspeed or args.fsdp or args.parallelism_config is not None:
        problems.append("DeepSpeed / FSDP / parallelism_config (generation with sharded parameters under CP is not "
                        "verified; pass cp_size= to the trainer and train with DDP)")
    return problems


def data_parallel_groups(model, args, cp_size) -> int:
    """The number of DP groups the run will have: a patched model's, else world / cp_size (None: one group)."""
    world = args.world_size
    state = None if isinstance(model, str) else cp_state(model)
    if state is not None:
        return state.mesh.dp_size
    cp = world if cp_size is UNSET or cp_size is None else cp_size
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world % cp:
        raise ValueError(f"cp_size={cp_size!r} must be a positive divisor of the number of processes ({world})")
    return world // cp


def generation_batch_per_dp_group(args, dp: int) -> None:
    """GRPOConfig sizes the generation batch by the number of processes; the ranks of a CP group share one batch, so
    it is per_device_train_batch_size x DP groups x steps_per_generation (steps_per_generation kept). The evaluation
    batch (per_device_eval_batch_size x DP groups) is checked to hold whole groups as GRPOConfig checks it.
    GRPOConfig leaves no trace of which of generation_batch_size / steps_per_generation a user set; when one was
    (steps_per_generation is not gradient_accumulation_steps) under CP, the batch taken is said in a warning."""
    counted_by_trl = args.generation_batch_size
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    cp = args.world_size // dp
    if cp > 1 and args.steps_per_generation != args.gradient_accumulation_steps:
        log.warning(f"HfcpGRPOTrainer generates {args.generation_batch_size} completions per generation "
                    f"(per_device_train_batch_size={args.per_device_train_batch_size} x {dp} DP groups x "
                    f"steps_per_generation={args.steps_per_generation}): the {cp} ranks of a CP group share one "
                    f"batch. GRPOConfig counted {counted_by_trl} over all {args.world_size} processes; if you set "
                    f"generation_batch_size={counted_by_trl}, set steps_per_generation="
                    f"{args.steps_per_generation * cp} instead for that many completions")
    if args.generation_batch_size % args.num_generations:
        raise ValueError(f"the generation batch of {args.per_device_train_batch_size} (per_device_train_batch_size) x "
                         f"{dp} (DP groups) x {args.steps_per_generation} (steps_per_generation) = "
                         f"{args.generation_batch_size} is not a multiple of num_generations={args.num_generations}: "
                         "under CP each DP group (not each process) takes a per-device batch")
    generations = args.num_generations_eval or args.num_generations
    if args.do_eval and args.eval_strategy != "no" and (args.per_device_eval_batch_size * dp) % generations:
        raise ValueError(f"the evaluation batch of {args.per_device_eval_batch_size} (per_device_eval_batch_size) x "
                         f"{dp} (DP groups) is not a multiple of the {generations} generations per prompt: under CP "
                         "each DP group (not each process) takes a per-device batch")


class HfcpGRPOTrainer(HfcpTrainerMixin, GRPOTrainer):
    """`trl.GRPOTrainer` for a context-parallel model (use_vllm=False): every argument of GRPOTrainer, plus
    hfcp.patch's options.

    Args:
        cp_size, strategy, loss_chunk, timeout, check_inputs, balance, tiled_mlp: as for HfcpTrainer (passed to
            `hfcp.patch`; the reference model, when TRL makes one, is patched alike).
    Logged per step as by GRPOTrainer (completion lengths, rewards, entropy, kl, clip ratios, ...), and by
    evaluate(), each DP group counted once.
    Raises:
        ValueError: what HfcpTrainer refuses; use_vllm, continuous batching, tools / environments / rollout_func, a
            vision-language model, a loss_type not in LOSS_TYPES (a newer TRL's, not verified), cast_lm_head_to_fp32,
            liger kernels, the entropy bonus, DeepSpeed / FSDP, the MoE router auxiliary loss, a reward model
            patched by hfcp, ddp_find_unused_parameters=True, and a generation or evaluation batch that does not hold
            whole groups of completions.
    """

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, *more, cp_size=UNSET,
                 strategy=UNSET, loss_chunk=UNSET, timeout=UNSET, check_inputs=UNSET, balance=UNSET,
                 tiled_mlp=UNSET, offload_checkpoints=UNSET, **kwargs):
        if args is None:  # GRPOTrainer's default, made here to size its batches
            name = model if isinstance(model, str) else (model.config._name_or_path or type(model).__name__)
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        given = inspect.signature(GRPOTrainer.__init__).bind(self, model, reward_funcs, args, *more, **kwargs).arguments
        problems = settings_problems(args, given)
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run exactly with: {'; '.join(problems)}")
        generation_batch_per_dp_group(args, data_parallel_groups(model, args, cp_size))
        args.ddp_find_unused_parameters = False  # (the Trainer's default is True without gradient checkpointing)
        self._hfcp_given = dict(cp_size=cp_size, strategy=strategy)  # read when the parent creates the Accelerator
        super(HfcpTrainerMixin, self).__init__(model, reward_funcs, args, *more, **kwargs)  # GRPOTrainer's
        self._hfcp_init(dict(cp_size=cp_size, strategy=strategy, loss_chunk=loss_chunk, timeout=timeout,
                             check_inputs=check_inputs, balance=balance, tiled_mlp=tiled_mlp,
                             offload_checkpoints=offload_checkpoints))
        state = cp_state(self.model)
        if state is not None:
            if self.ref_model is not None:
                settings = state.settings
                patch(self.ref_model, **{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
            set_seed(self.args.seed + state.mesh.dp_rank)  # TRL: seed + process index; here the same in a CP group

    def _hfcp_refuse_unsupported(self) -> None:
        problems = []
        if self._is_vlm:
            problems.append("a vision-language model (hfcp.sequence_logps takes text-only causal LMs)")
        if self.aux_loss_enabled:
            problems.append("the MoE router auxiliary loss (router_aux_loss_coef; not verified under CP: set it to 0)")
        patched = [name for f, name in zip(self.reward_funcs, self.reward_func_names)
                   if isinstance(f, torch.nn.Module) and cp_state(f) is not None]
        if patched:
            problems.append(f"reward models patched by hfcp ({patched}: the first rank of each CP group scores the "
                            "completions alone; pass them unpatched)")
        if problems:
            raise ValueError(f"{type(self).__name__} cannot run exactly with: {'; '.join(problems)}")
        super()._hfcp_refuse_unsupported()

    # ---- generation, rewards and loss: TRL's, with each DP group counted once ------------------------------------
    def _generate_and_score_completions(self, inputs):
        with data_parallel_view(self, _TRL_MODULE):
            return super()._generate_and_score_completions(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with data_parallel_view(self, _TRL_MODULE):
            return GRPOTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return GRPOTrainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """The rewards (all DP groups, (B x dp, reward functions)): computed by the first rank of each CP group and
        broadcast to the others; an error of a reward function is raised on every rank of the group."""
        state = cp_state(self.model)
        if state is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        first = state.mesh.data_leaders[state.mesh.dp_rank]
        outcome = None
        if state.mesh.cp_rank == 0:
            try:
                with gathers_kept_local(_TRL_MODULE):
                    outcome = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list).cpu()
            except Exception as e:  # shared below, so that no rank of the group waits for rewards that never come
                error, outcome = e, f"{type(e).__name__}: {e}"
        shared = [outcome]
        dist.broadcast_object_list(shared, src=first, group=state.mesh.cp_group)
        if isinstance(shared[0], str):
            if state.mesh.cp_rank == 0:
                raise error
            raise RuntimeError(f"the reward functions raised on rank {first}, which computes this CP group's rewards: "
                               f"{shared[0]}")
        return self.accelerator.gather(shared[0].to(self.accelerator.device))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if cp_state(self.model) is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:  # refused at __init__ (a VLM, the router aux loss): never reached
            raise ValueError(f"HfcpGRPOTrainer computes log-probabilities of text-only models without the router aux "
                             f"loss; got {given or 'compute_aux_loss'}")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                lp, ent = completion_logps(model, input_ids[rows], attention_mask[rows], logits_to_keep,
                                           self.temperature, compute_entropy)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None
