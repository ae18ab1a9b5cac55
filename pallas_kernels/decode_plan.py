"""How a decode step is cut into programs: KV heads packed per tile, and the number of context splits.

Both decode kernels (Triton `decode.py`, Mosaic `mosaic/attention.py`) are bound by reading K/V, so
the plan has two goals: every byte the kernel moves besides K/V is small against K/V, and there
are enough programs to keep an H100's 132 SMs reading.

Packed heads. A tile has `rows` query rows (16 for the Triton kernel: the smallest `tl.dot`; 64
for Mosaic: one wgmma M tile). A GQA group of G query heads fills G rows, so one KV head per tile
would leave rows - G rows of padding (14 of 16 for Qwen3's G = 2), computed and, with splits,
written as float32 partials. Instead a tile holds the groups of `heads_per_tile` consecutive KV
heads of one sequence (one sequence: one block table, one length):

    G = 2, 8 KV heads, 16 rows:   row r = local_head * G + g      (query head = first_head * G + r)
    rows:  0 1 | 2 3 | 4 5 | ... | 14 15
    head:   0  |  1  |  2  | ... |   7        one program reads all 8 KV heads' pages of the sequence

The program loops over (key block, local head): each step reads ONE KV head's K/V block and
updates only that head's rows (the others are masked, so their running max and sum do not move).
The work per step equals the unpacked kernel's; there are `heads_per_tile` times fewer programs,
each doing that many times more steps, and every row of the tile (and of its partials) is real.

Packing trades programs for dense rows, so the engine packs only while the batch still fills the
machine: batch 256 x 8 KV heads -> 8 heads per tile (256 programs); batch 64 -> 2 (256 programs);
batch 16 or less -> 1 (one KV head per program, and splits).

Splits. Programs = num_seqs x num_kv_heads / heads_per_tile x num_splits. When num_seqs x KV-head
tiles already fill the machine (>= NUM_SMS), one split: no float32 partials at all, the kernel
writes the normalised output. With splits, a program stores only the real rows of its tile
(Hp x G, up to a power of two) as partials, not the padded tile. Otherwise enough splits for about 2 programs per SM, but never so
many that a full split's float32 partials (out, max, sum; written by the kernel and read back by the
combine) pass PARTIALS_BUDGET of the K/V bytes that split reads. The budget is against the block
table's width (`pages_per_seq`), known when the program is traced; sequences shorter than the table
read fewer pages while their splits' partials keep their size.
"""

NUM_SMS = 132  # H100 SXM; the plan is made at trace time, possibly on a machine without the GPU
PARTIALS_BUDGET = 0.04  # partial bytes (written + read) per K/V byte of a full split; the target is 5%


def heads_per_tile(num_kv_heads: int, group: int, rows: int, num_seqs: int | None = None) -> int:
    """KV heads per tile: the largest divisor of `num_kv_heads` whose groups fit `rows` rows and,
    given `num_seqs`, that still leaves num_seqs x tiles >= NUM_SMS programs (no split needed). A
    batch that cannot fill the GPU even with one KV head per program gets 1: its splits then
    multiply the programs, and each split's partials hold only its G real rows."""
    fits = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0 and d * group <= max(rows, group)]
    if num_seqs is not None:
        fits = [d for d in fits if num_seqs * (num_kv_heads // d) >= NUM_SMS] or [1]
    return max(fits)


def num_splits_for(
    *,
    num_tiles: int,
    pages_per_seq: int,
    pages_per_block: int,
    partial_bytes_per_split: int,
    kv_bytes_per_page: int,
) -> int:
    """Context splits per (sequence, KV-head tile).

    num_tiles: num_seqs x (num_kv_heads / heads_per_tile), the programs of one split;
    pages_per_block: a split holds whole blocks of this many pages;
    partial_bytes_per_split: float32 bytes one split writes AND the combine reads back;
    kv_bytes_per_page: K and V bytes (scales included) one tile reads per page of its sequence.
    """
    if num_tiles >= NUM_SMS:
        return 1
    wanted = -(-2 * NUM_SMS // num_tiles)
    min_pages = -(-partial_bytes_per_split // max(1, int(PARTIALS_BUDGET * kv_bytes_per_page)))
    min_pages = -(-min_pages // pages_per_block) * pages_per_block  # whole compute blocks
    return max(1, min(wanted, pages_per_seq // min_pages))
