"""The inputs users pass: a transformers `BatchEncoding`, any Mapping or pytree-registered structure, and
a FlexAttention `BlockMask` built per batch for packed documents, passed in or set on a module. Each is
an input like a tensor (copied in per call, its Python values in the key), rebuilt with the caller's
type, and the step is bitwise equal to eager with one capture."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
from torch.utils import _pytree as pytree

import graphstep
from graphstep.errors import UnsupportedInputError
from graphstep.signature import Signature, unflatten

RECORDING = graphstep.Config(backend="recording", warmup_steps=2)
V, D, S, BLOCK = 32, 16, 64, 16


class Encoder(torch.nn.Module):
    """Takes what a tokenizer returns: `model(**batch)`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)

    def forward(self, input_ids, attention_mask):  # (B, T) each
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.head(torch.tanh(h))


def lm_step(model, opt, seen=None):
    def step(batch):
        if seen is not None:
            seen.append(type(batch))
        logits = model(**batch)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def twins(make=Encoder):
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    return (model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)), (
        twin,
        torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9),
    )


def token_batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (2, 12), generator=g)
        mask = (torch.rand(2, 12, generator=g) > 0.2).long()
        out.append((ids, mask))
    return out


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_batch_encoding_is_an_input_rebuilt_as_a_batch_encoding():
    from transformers import BatchEncoding

    (m_e, o_e), (m_g, o_g) = twins()
    seen: list[type] = []
    noted = graphstep.Config(backend="recording", warmup_steps=2, allow_python_writes=True)  # `seen`
    eager, step = lm_step(m_e, o_e), graphstep.capture(lm_step(m_g, o_g, seen), config=noted)
    for ids, mask in token_batches(8):
        a = eager(BatchEncoding({"input_ids": ids, "attention_mask": mask}))
        b = step(BatchEncoding({"input_ids": ids, "attention_mask": mask}))
        assert torch.equal(a, b)
    assert same_params(m_e, m_g)
    assert step.stats.captures == 1 and step.stats.replays == 5
    assert seen == [BatchEncoding] * 3, seen  # two warm-ups and the capture, each with the user's type


def test_a_batch_encodings_tokenizer_encodings_read_in_the_step_are_refused_at_capture():
    from transformers import BatchEncoding

    class Encoding:  # what a fast tokenizer keeps per sequence, on the host
        n_sequences = 1

        def __init__(self, words):
            self.word_ids = words

    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        words = torch.tensor([w if w is not None else -1 for w in batch.word_ids(0)])  # host data
        loss = lm_step(model, opt)(batch) + 0 * words.sum()
        return loss

    captured = graphstep.capture(step, config=RECORDING)
    ids, mask = token_batches(1)[0]
    encodings = [Encoding(list(range(12))), Encoding(list(range(12)))]
    for _ in range(2):
        captured(BatchEncoding({"input_ids": ids, "attention_mask": mask}, encoding=encodings))
    with pytest.raises(UnsupportedInputError, match=r"word_ids\(\).*pass it as a tensor"):
        captured(BatchEncoding({"input_ids": ids, "attention_mask": mask}, encoding=encodings))

    # The same batches to a step that does not read them: captured, and replayed.
    other = Encoder()
    plain = graphstep.capture(lm_step(other, torch.optim.SGD(other.parameters(), lr=0.1)), config=RECORDING)
    for _ in range(4):
        plain(BatchEncoding({"input_ids": ids, "attention_mask": mask}, encoding=encodings))
    assert plain.stats.captures == 1 and plain.stats.replays == 1


class Pair:
    """A user structure registered with torch's pytree: a tensor and a Python value."""

    def __init__(self, x, scale):
        self.x, self.scale = x, scale


pytree.register_pytree_node(
    Pair,
    lambda p: ([p.x], p.scale),
    lambda leaves, scale: Pair(leaves[0], scale),
    serialized_type_name="t.Pair",
)


def test_mappings_and_pytree_nodes_are_containers_of_the_callers_type():
    @dataclasses.dataclass
    class Batch:  # the pre-existing containers still nest inside the new ones
        z: torch.Tensor

    seen = []

    def fn(user: collections.UserDict, pair: Pair, od: collections.OrderedDict):
        seen.append((type(user), type(pair), type(od)))
        return user["a"] * user["k"] + pair.x * pair.scale + od["b"].z

    config = graphstep.Config(backend="recording", warmup_steps=1, allow_python_writes=True)  # `seen`
    step = graphstep.capture(fn, config=config)
    for _ in range(4):
        a, x, z = torch.randn(3), torch.randn(3), torch.randn(3)
        got = step(collections.UserDict(a=a, k=2), Pair(x, 3.0), collections.OrderedDict(b=Batch(z)))
        assert torch.equal(got, a * 2 + x * 3.0 + z)
    assert step.stats.captures == 1 and step.stats.replays == 2
    assert set(seen) == {(collections.UserDict, Pair, collections.OrderedDict)}
    step(collections.UserDict(a=a, k=5), Pair(x, 3.0), collections.OrderedDict(b=Batch(z)))  # a new value
    step(collections.UserDict(a=a, k=2), Pair(x, 4.0), collections.OrderedDict(b=Batch(z)))  # in the context
    assert step.stats.warmup_calls == 3, "each Python value is another signature"
    signature, leaves = Signature.of((collections.UserDict(a=a, k=2),), {})
    assert (
        "args[0]['a']: float32[3]" in signature.describe() and "args[0]['k']: int 2" in signature.describe()
    )
    assert type(unflatten(signature.spec, leaves)[0][0]) is collections.UserDict


# -- FlexAttention's BlockMask, built per batch for packed documents ----------------------------------


def attend(q, k, v, block_mask):  # q, k, v: (B, H, S, D/H)
    """FlexAttention's mask semantics in plain torch (FlexAttention has no backward on the CPU): the
    mask function on every (q, kv) pair, within the blocks the BlockMask keeps."""
    idx = torch.arange(S)
    allowed = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
    blocks = block_mask.to_dense()[0, 0].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1).bool()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed & blocks)


class PackedLM(torch.nn.Module):
    """A one-block transformer over packed documents; the mask comes in or sits on `attn_mask_holder`."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.out = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V)
        self.block_mask = None

    def forward(self, ids, block_mask=None):  # ids: (B, S)
        mask = block_mask if block_mask is not None else self.block_mask
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(ids.shape[0], S, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(ids.shape[0], S, D)
        return self.head(h + self.out(y))


def document_mask(doc, size=BLOCK):
    from torch.nn.attention.flex_attention import create_block_mask

    def doc_causal(b, h, q, kv):  # closes over this batch's document ids
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(doc_causal, None, None, S, S, device="cpu", BLOCK_SIZE=size)


def packed_batches(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        doc = torch.zeros(S, dtype=torch.long)
        for cut in torch.randint(1, S, (3,), generator=g).tolist():
            doc[cut:] += 1
        out.append((torch.randint(0, V, (2, S), generator=g), doc))
    return out


def packed_step(model, opt, on_module):
    def step(ids, block_mask=None):
        logits = model(ids) if on_module else model(ids, block_mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.filterwarnings("ignore:.*flex_attention:UserWarning")
@pytest.mark.parametrize("on_module", [False, True], ids=["passed_in", "on_module"])
def test_a_new_block_mask_every_batch_is_one_graph_bitwise_equal_to_eager(on_module):
    (m_e, o_e), (m_g, o_g) = twins(PackedLM)
    eager = packed_step(m_e, o_e, on_module)
    step = graphstep.capture(packed_step(m_g, o_g, on_module), model=m_g, config=RECORDING)
    data = packed_batches(8)
    assert len({tuple(doc.tolist()) for _, doc in data}) == 8, "every batch packs its documents differently"
    for ids, doc in data:
        mask = document_mask(doc)
        if on_module:
            m_e.block_mask = m_g.block_mask = mask
            a, b = eager(ids), step(ids)
        else:
            a, b = eager(ids, mask), step(ids, mask)
        assert torch.equal(a, b)
    assert same_params(m_e, m_g)
    assert step.stats.captures == 1 and step.stats.replays == 5
    assert m_g.block_mask is (mask if on_module else None), "the user's mask is back on the module"

    # Another mask function (another code object) or block size is another graph, still equal.
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    for ids, _ in packed_batches(6, seed=3):
        mask = create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
        if on_module:
            m_e.block_mask = m_g.block_mask = mask
            a, b = eager(ids), step(ids)
        else:
            a, b = eager(ids, mask), step(ids, mask)
        assert torch.equal(a, b)
    assert same_params(m_e, m_g)
    assert step.stats.captures == 2


def test_a_block_mask_key_is_its_mask_function_block_size_and_shapes_not_its_values():
    a, b = packed_batches(2)
    mask_a, mask_b = document_mask(a[1]), document_mask(b[1])
    assert not torch.equal(mask_a.to_dense(), mask_b.to_dense())
    sig_a, _ = Signature.of((mask_a,), {})
    sig_b, leaves_b = Signature.of((mask_b,), {})
    assert sig_a == sig_b
    assert Signature.of((document_mask(a[1], size=32),), {})[0] != sig_a
    assert "args[0].mask_mod.<closure doc>: int64[64]" in sig_a.describe()
    rebuilt = unflatten(sig_b.spec, leaves_b)[0][0]
    assert rebuilt.kv_indices is mask_b.kv_indices and rebuilt.mask_mod is not mask_b.mask_mod
    assert rebuilt.mask_mod.__closure__[0].cell_contents is b[1]
    assert torch.equal(rebuilt.to_dense(), mask_b.to_dense())


def test_a_composed_mask_function_is_keyed_by_the_code_of_each_part_and_rebuilt_over_the_buffers():
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    def composed(doc):
        def same_document(b, h, q, kv):
            return doc[q] == doc[kv]

        mask_mod = and_masks(causal, same_document)  # a closure over a tuple of functions
        return create_block_mask(mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)

    (_, doc_a), (_, doc_b) = packed_batches(2)
    sig_a, _ = Signature.of((composed(doc_a),), {})
    sig_b, leaves_b = Signature.of((composed(doc_b),), {})
    assert sig_a == sig_b and Signature.of((document_mask(doc_a),), {})[0] != sig_a
    copies = [t.clone() for t in leaves_b]
    rebuilt = unflatten(sig_b.spec, copies)[0][0]
    idx, zero = torch.arange(S), torch.tensor(0)
    want = composed(doc_b).mask_mod(zero, zero, idx[:, None], idx[None, :])
    assert torch.equal(rebuilt.mask_mod(zero, zero, idx[:, None], idx[None, :]), want)
    copies[-1].fill_(0)  # the document ids the rebuilt function reads are the buffer's
    assert rebuilt.mask_mod(zero, zero, idx[:, None], idx[None, :]).sum() == S * (S + 1) // 2
