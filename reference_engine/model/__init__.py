"""The reference engine's model: a small transformer whose answer is a function of its KV pages.

Modules, one concept each:

    rotary           rotary positions, applied when K is read (K is stored un-rotated)
    attention        paged attention in torch: the oracle the kernel is tested against
    triton_attention the same paged attention as a Triton kernel, through the block table
    attention_path   which of the two a side runs, and the one line that says so
    naive_attention  the contiguous-cache oracle the paged path is tested against
    cache            the views the model writes K/V through: paged pool or contiguous buffers
    layers           RMSNorm, the SwiGLU MLP, an ordinary attention block
    recall           token codes, the embedding and the recall layer (constructed weights)
    transformer      the whole model and its ForwardBatch

What the model deliberately is not: a language model. Its ordinary layers have random weights
and exist so that prefill cost and KV memory are real; its last layer is a recall head with
constructed weights that quotes the tokens whose KV sits at scheduled positions, exactly at
`copy_noise` 0, and above it the way a model copying from foreign KV does: in runs, with
drops, substitutions and drift that depend on every layer's K/V bytes.
"""
