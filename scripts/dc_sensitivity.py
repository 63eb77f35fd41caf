"""Enc-DC against the Transformer at initialisation, post-norm (docs/numerics.md, "Enc-DC"):

* beta per encoder layer: Var(sublayer) / Var(residual + sublayer) of the self-attention
  sublayer (the DC module in Enc-DC), the branch dependence that makes post-norm training
  unstable (Liu et al. 2020, "Understanding the Difficulty of Training Transformers");
* the gradient norm per encoder layer of one batch's cross-entropy;
* the relative change of the encoder output after one step of size ``--step`` on every
  element of the encoder's parameters, in the gradient's sign (Adam's first update): all of
  them, the self-attention sublayers' only, the others only.

Random weights and tokens, one seed, CPU, float32. Example (about 30 s on one core)::

    OMP_NUM_THREADS=1 python scripts/dc_sensitivity.py --embed-dim 512 --layers 6 --heads 8
    OMP_NUM_THREADS=1 python scripts/dc_sensitivity.py --embed-dim 128 --layers 3 --heads 4
"""
import argparse
import math

import torch
import torch.nn.functional as F
from fairseq import options, tasks
from fairseq.data import Dictionary

import mlmha_fairseq
from mlmha_fairseq.evaluation.numerics import layer_gradient_norms
from mlmha_fairseq.modules.dual_contextual import DualContextual

SYSTEMS = {"transformer": [], "enc-dc": ["--dc-encoder-layers", "all"]}


def build(arch_options, embed_dim, layers, heads, dictionary):
    sizes = []
    for side in ("encoder", "decoder"):
        sizes += [f"--{side}-embed-dim", embed_dim, f"--{side}-ffn-embed-dim", 4 * embed_dim,
                  f"--{side}-attention-heads", heads, f"--{side}-layers", layers]
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused", "--task", "translation", "--user-dir", mlmha_fairseq.__path__[0], "--arch", "slot_transformer",
        "--share-all-embeddings", *map(str, sizes), *arch_options])
    return tasks.translation.TranslationTask(args, dictionary, dictionary).build_model(args).eval()


def reinitialise(model, init: str):
    """Every DC module with ``init``: ``one-xavier-w-z``, ``W_z`` (2d x d) as one Xavier-uniform
    matrix, U(+-sqrt(6 / 3d)), instead of its two d x d blocks (the FI units' output
    projections) each on its own; ``xavier-conv``, the local unit's convolution Xavier-uniform
    (fairseq's Linear layers' init) instead of PyTorch's default U(+-1/sqrt(f d))."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DualContextual):
                if init == "one-xavier-w-z":
                    bound = math.sqrt(6 / (3 * module.embed_dim))
                    for unit in (module.local_interaction, module.global_interaction):
                        unit.out_proj.weight.uniform_(-bound, bound)
                elif init == "xavier-conv":
                    torch.nn.init.xavier_uniform_(module.local_unit.conv.weight)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embed-dim", type=int, default=512, help="d (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=6, help="layers per stack (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: %(default)s)")
    parser.add_argument("--step", type=float, default=3e-5, help="step per element (default: %(default)s)")
    parser.add_argument("--init", choices=("default", "one-xavier-w-z", "xavier-conv"), default="default",
                        help="Enc-DC's initialisation (default: %(default)s, the package's)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dictionary = Dictionary()
    for index in range(1000):
        dictionary.add_symbol(f"w{index}")
    src = torch.randint(dictionary.nspecial, len(dictionary), (16, 30))
    lengths = torch.randint(10, 31, (16,))
    for row, length in enumerate(lengths.tolist()):  # left-padded, as fairseq's collater
        src[row, :30 - length] = dictionary.pad()
    prev = torch.randint(dictionary.nspecial, len(dictionary), (16, 30))
    pad, real = src.eq(dictionary.pad()), src.ne(dictionary.pad()).T
    for name, arch_options in SYSTEMS.items():
        torch.manual_seed(0)
        model = build(arch_options, args.embed_dim, args.layers, args.heads, dictionary)
        if arch_options:
            reinitialise(model, args.init)
        betas = []

        def branch_dependence(layer, inputs, _output):
            x = inputs[0]
            branch = layer.self_attn(query=x, key=x, value=x, key_padding_mask=pad, need_weights=False)[0]
            betas.append(float(branch.var() / (x + branch).var()))

        handles = [layer.register_forward_hook(branch_dependence) for layer in model.encoder.layers]
        with torch.no_grad():
            before = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        for handle in handles:
            handle.remove()
        logits = model(src, lengths, prev)[0]
        F.cross_entropy(logits.flatten(0, 1), prev.roll(-1, 1).flatten()).backward()
        norms = layer_gradient_norms(model.encoder)
        changes = {}
        for group in ("all", "self-attention", "other"):
            saved = {key: value.clone() for key, value in model.state_dict().items()}
            with torch.no_grad():
                for parameter_name, parameter in model.encoder.named_parameters():
                    in_self_attention = ".self_attn." in parameter_name
                    if parameter.grad is not None and (group == "all" or in_self_attention == (group == "self-attention")):
                        parameter.sub_(args.step * parameter.grad.sign())
                after = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
            model.load_state_dict(saved)
            changes[group] = float((after - before)[real].norm() / before[real].norm())
        print(f"{name}: beta per layer {' '.join(f'{beta:.2f}' for beta in betas)}")
        layer_norms = " ".join(f"{norms['layers.' + str(index)]:.2f}" for index in range(args.layers))
        print(f"  gradient norm per layer {layer_norms}")
        print("  relative change of the encoder output after a step on "
              + ", ".join(f"{group}: {change:.3f}" for group, change in changes.items()))


if __name__ == "__main__":
    main()
