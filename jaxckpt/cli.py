"""Command line: `jaxckpt demo` runs the end-to-end prefix-cache demo; `jaxckpt plan` prints a batch's checkpoint plan.

`jaxckpt plan` needs only numpy; the demo imports jax on first use (after `--devices N` asked for N host devices).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from jaxckpt.plan import batch_checkpoints, chunk_layout, split_layout
from jaxckpt.plan.scheduler import SchedulerConfig, block_aligned_split

SAMPLE_PROMPTS = "8000,2200:1500,1159,700,5000:331"


def _parse_prompts(text: str) -> list[tuple[int, int]]:
    """"LEN[:COMPUTED],..." -> [(prompt_len, computed_tokens)]."""
    prompts = []
    for item in text.split(","):
        length, _, computed = item.partition(":")
        prompts.append((int(length), int(computed or 0)))
    return prompts


def plan_command(args: argparse.Namespace) -> int:
    hash_block = args.hash_block_size or args.block_size
    config_kwargs = dict(block_size=args.block_size, hash_block_size=hash_block,
                         max_num_scheduled_tokens=args.budget, eagle_block_drop=args.eagle)
    plain = SchedulerConfig(**config_kwargs)
    ckpt = SchedulerConfig(**config_kwargs, has_checkpoint_blocks=True, checkpoint_alignment=args.alignment)
    prompts = _parse_prompts(args.prompts)
    print(f"block_size={args.block_size} hash_block_size={hash_block} alignment={args.alignment} "
          f"max_checkpoints_per_row={args.max_checkpoints_per_row} policy={args.policy}")
    print(f"{'row':>3} {'prompt':>7} {'computed':>8} | {'steps without ckpt':<22} | {'with ckpt':<14} | "
          f"checkpoints this step (offset -> block column)")
    starts, ends = [], []
    for n, (length, computed) in enumerate(prompts):
        steps, done = [], computed
        while done < length:
            scheduled = block_aligned_split(plain, num_prompt_tokens=length, num_tokens=length,
                                            num_computed_tokens=done, num_new_tokens=min(length - done, args.budget))
            if scheduled == 0:
                break
            steps.append(scheduled)
            done += scheduled
        first = block_aligned_split(ckpt, num_prompt_tokens=length, num_tokens=length, num_computed_tokens=computed,
                                    num_new_tokens=min(length - computed, args.budget))
        starts.append(computed)
        ends.append(computed + first)
        cu, offsets, columns = batch_checkpoints(
            [computed], [computed + first], hash_block_size=hash_block, block_size=args.block_size,
            alignment=args.alignment, max_checkpoints_per_row=args.max_checkpoints_per_row, policy=args.policy,
            drop_eagle_block=args.eagle)
        pairs = ", ".join(f"{o} -> {c}" for o, c in zip(offsets.tolist(), columns.tolist())) or "none"
        print(f"{n:>3} {length:>7} {computed:>8} | {'+'.join(map(str, steps)):<22} | {first:<14} | {pairs}")

    cu_seqlens = np.concatenate([[0], np.cumsum(np.asarray(ends) - np.asarray(starts))]).astype(np.int32)
    ccu, offsets, _ = batch_checkpoints(starts, ends, hash_block_size=hash_block, block_size=args.block_size,
                                        alignment=args.alignment, max_checkpoints_per_row=args.max_checkpoints_per_row,
                                        policy=args.policy, drop_eagle_block=args.eagle)
    layout = chunk_layout(cu_seqlens, ccu, offsets, chunk_size=args.chunk_size, num_tokens=int(cu_seqlens[-1]))
    used = int((layout.chunk_len > 0).sum())
    print(f"\none forward: {int(cu_seqlens[-1])} tokens, {len(prompts)} rows, {len(offsets)} checkpoints, "
          f"{used} chunks of {args.chunk_size} (in-chunk export)")
    for j, (row, chunk, pos) in enumerate(zip(layout.checkpoint_row, layout.checkpoint_chunk, layout.checkpoint_pos)):
        print(f"  checkpoint {j}: row {row}, offset {offsets[j]} = chunk {chunk} + {pos} tokens")
    launches = split_layout(cu_seqlens, ccu, offsets)
    print(f"split-at-checkpoint: {len(launches)} dependent launches, tokens per launch "
          f"{[int(launch.cu_seqlens[-1]) for launch in launches]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan the checkpoints of a sample batch and print the plan")
    plan.add_argument("--prompts", default=SAMPLE_PROMPTS, help="LEN[:COMPUTED],... (default: %(default)s)")
    plan.add_argument("--block-size", type=int, default=768)
    plan.add_argument("--hash-block-size", type=int, default=None, help="prefix-match unit (default: block size)")
    plan.add_argument("--alignment", type=int, default=1, help="the kernels' checkpoint alignment")
    plan.add_argument("--max-checkpoints-per-row", type=int, default=1)
    plan.add_argument("--policy", choices=("vllm", "every_block"), default="vllm")
    plan.add_argument("--budget", type=int, default=8192, help="tokens per step")
    plan.add_argument("--chunk-size", type=int, default=64)
    plan.add_argument("--eagle", action="store_true", help="EAGLE block drop")
    plan.set_defaults(func=plan_command)
    sub.add_parser("demo", help="stream a shared-prefix workload through the engine (`jaxckpt demo --help`)")
    return parser


def request_host_devices(argv: list[str]):
    """`demo --devices N` on the CPU needs N host devices, a count XLA fixes when JAX starts: ask for them before the
    demo imports JAX. Harmless on a GPU host (the flag only sizes the CPU platform; the mesh takes the first N GPUs);
    too late once JAX is imported, where the demo reports the devices missing."""
    parser = argparse.ArgumentParser(prog="jaxckpt demo", add_help=False)
    parser.add_argument("--devices", type=int, default=None)
    devices = parser.parse_known_args(argv)[0].devices
    flags = os.environ.get("XLA_FLAGS", "")
    if devices is None or devices < 2 or "jax" in sys.modules or "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        request_host_devices(argv[1:])
        from jaxckpt.engine.demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
