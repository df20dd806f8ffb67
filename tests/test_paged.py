"""The paged baseline: block tables, gathers, and sharing by reference counts."""
import torch

from conftest import fill, make_cache, live


def test_tokens_land_in_the_blocks_the_table_names():
    cache = make_cache("paged", block_size=16)
    a, b = cache.allocate(40), cache.allocate(20)
    data = fill(cache, a, 40)
    fill(cache, b, 20, seed=1)
    assert len(cache.block_table(a)) == 3 and len(cache.block_table(b)) == 2
    assert not set(cache.block_table(a)) & set(cache.block_table(b))
    for t in (0, 15, 16, 39):
        row = cache.block_table(a)[t // 16] * 16 + t % 16
        assert torch.equal(cache.storage.pools[2][row], data[1][0][t])  # layer 1's K
    assert cache.map_calls == 2  # a table update per allocation, counted as the virtual cache counts maps
    assert cache.config.page_size == 16 * cache.config.token_bytes


def test_kernels_given_block_tables_find_each_token_in_the_layers_blocks():
    """`layer_blocks` and `block_tables`, what FlashAttention's paged call
    reads: token t of row r is block `tables[r][t // block_size]`, row t % block_size."""
    cache = make_cache("paged", block_size=16)
    a, b = cache.allocate(40), cache.allocate(20)
    data = {a: fill(cache, a, 40), b: fill(cache, b, 20, seed=1)}
    tables = cache.data.block_tables([b, a])
    zero = cache.storage.zero_block
    assert tables == [cache.block_table(b) + [zero], cache.block_table(a)]  # one width, padded with the zero block
    K, V = cache.data.views(1)
    assert K.shape == (cache.pool.num_pages + 1, 16, cache.config.num_kv_heads, cache.config.head_dim)
    for r, slot in enumerate([b, a]):
        for t in (0, 15, 16, len(data[slot][1][0]) - 1):
            block, k, v = tables[r][t // 16], data[slot][1][0][t], data[slot][1][1][t]
            assert torch.equal(K[block, t % 16], k) and torch.equal(V[block, t % 16], v)
    assert float(K[zero].abs().sum()) == 0


def test_a_steps_write_rows_are_built_once_for_every_layer_and_again_when_a_table_changes():
    cache = make_cache("paged", block_size=16)
    a, b = cache.allocate(17), cache.allocate(3)
    fill(cache, a, 16)
    fill(cache, b, 2)
    c = cache.config
    k = torch.randn(2, 1, c.num_kv_heads, c.head_dim)
    built = []
    for layer in range(c.num_layers):
        cache.data.write(layer, [a, b], [16, 2], k, -k)
        built.append(cache.storage._write_rows([a, b], [cache.block_table(a), cache.block_table(b)], [16, 2], 1))
    assert built[0] is built[1]  # one index for the step's layers
    assert built[0].tolist() == [cache.block_table(a)[1] * 16, cache.block_table(b)[0] * 16 + 2]
    assert cache.grow(b, 40)  # a table changes: the next write builds its rows again
    cache.data.write(0, [a, b], [16, 2], k, -k)
    assert cache.storage._write_rows([a, b], [cache.block_table(a), cache.block_table(b)], [16, 2], 1) \
        is not built[0]
    for slot, pos, want in ((a, 16, k[0, 0]), (b, 2, k[1, 0])):
        row = cache.block_table(slot)[pos // 16] * 16 + pos % 16
        assert torch.equal(cache.storage.pools[0][row], want) and torch.equal(cache.storage.pools[1][row], -want)


def test_gather_reads_live_rows_and_zeros_past_a_table():
    cache = make_cache("paged", block_size=4)
    a, b = cache.allocate(10), cache.allocate(3)
    ka = fill(cache, a, 10)[0][0]
    kb = fill(cache, b, 3, seed=2)[0][0]
    K, _ = cache.data.rows(0, a, b + 1, 10)
    assert K.shape == (2, 10, 3, 8)
    assert torch.equal(K[0], ka) and torch.equal(K[1, :3], kb)
    assert not K[1, 4:].any()  # b has one block: past it, the zero block
    again, _ = cache.data.rows(0, a, b + 1, 10)
    assert again.data_ptr() == K.data_ptr()  # one reused buffer


def test_forks_share_blocks_and_copy_the_tail():
    cache = make_cache("paged", block_size=16)
    a = cache.allocate(40)
    data = fill(cache, a, 40)
    b = cache.fork(a, 40)
    assert cache.block_table(b)[:2] == cache.block_table(a)[:2]  # full blocks shared
    assert cache.block_table(b)[2] != cache.block_table(a)[2]  # the tail block copied
    assert cache.pool.num_shared == 2
    for layer in range(2):
        assert torch.equal(live(cache, b, layer)[0], data[layer][0])
    assert cache.grow(b, 41)
    cache.data.write(0, [b], [40], *(torch.ones(1, 1, 3, 8),) * 2)  # the private tail takes it
    assert cache.length(a, 0) == 40 and torch.equal(live(cache, a, 0)[0], data[0][0])
    cache.free(a)
    cache.free(b)
    cache.check()


def test_swap_round_trip_and_trim():
    cache = make_cache("paged", block_size=16, pages=8)
    a = cache.allocate(100)
    data = fill(cache, a, 100)
    swapped = cache.swap_out(a)
    assert cache.stats().pages_mapped == 0
    back = cache.swap_in(swapped)
    for layer in range(2):
        assert torch.equal(live(cache, back, layer)[1], data[layer][1])
    cache.free(back)
    assert cache.trim() == 7 and cache.stats().pages_free == cache.stats().pages_total
