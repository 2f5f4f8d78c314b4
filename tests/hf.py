"""Small Hugging Face models built from configs (random weights, no downloads)."""

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)


def gpt2(layers: int = 4) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert(layers: int = 4) -> BertForMaskedLM:
    config = BertConfig(
        num_hidden_layers=layers, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return BertForMaskedLM(config)


def llama(layers: int = 4) -> LlamaForCausalLM:
    """Grouped-query attention (2 key/value heads for 4), RMSNorm, rotary positions, SwiGLU; its
    decoder sits under a submodule named `model`."""
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, attention_dropout=0.0,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )
    return LlamaForCausalLM(config)


def t5(layers: int = 2) -> T5ForConditionalGeneration:
    """Encoder-decoder: the encoder's output feeds every decoder layer; embeddings and head tied."""
    config = T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=32, d_ff=64, d_kv=8, num_heads=4,
        vocab_size=128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def lm_batches(steps: int = 3, batch: int = 8, length: int = 8, vocab: int = 128, seed: int = 0):
    """Keyword batches with labels = input_ids (the model shifts them itself)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, vocab, (batch, length), generator=generator)
        out.append(({"input_ids": ids, "labels": ids.clone()}, None))
    return out
