"""Stand-ins for SGLang's host KV pools and storage config, for the adapter's tests where SGLang is not installed.

They hold real torch tensors in SGLang 0.5.23's exact buffer shapes (`MHATokenToKVPoolHost.init_kv_buffer`,
`MLATokenToKVPoolHost.init_kv_buffer`) and implement its page methods the way it does (`get_data_page`,
`set_from_flat_data_page`, `get_dummy_flat_data_page`). tests/integration/test_engine_sglang.py checks them
against SGLang's own classes where SGLang is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FakeStorageConfig:
    """SGLang's HiCacheStorageConfig: the same fields, the same writer rule."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = False
    model_name: str | None = "test-model@r1"
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: dict | None = field(default_factory=dict)
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None

    @property
    def is_storage_writer(self) -> bool:
        """SGLang's rule: MLA writes from one rank per DCP shard, MHA from every rank."""
        return not self.is_mla_model or self.tp_rank == self.dcp_rank


class FakeMHAHostPool:
    """SGLang's MHATokenToKVPoolHost: K and V of every layer for `size` token slots, in one (2, ...) buffer."""

    def __init__(self, layout: str, page_size: int, pages: int = 8, layers: int = 2, heads: int = 2,
                 head_dim: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.page_size, self.dtype = layout, page_size, dtype
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = layers, heads, head_dim, head_dim
        self.page_num = pages
        self.size = pages * page_size
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
            "page_head": (2, pages, heads, page_size, layers, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[:, real:real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        ps, L, H, D = self.page_size, self.layer_num, self.head_num, self.head_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + ps] = data_page.reshape(2, L, ps, H, D)
        elif self.layout == "page_first":
            self.kv_buffer[:, index:index + ps] = data_page.reshape(2, ps, L, H, D)
        else:
            real = index // ps
            self.kv_buffer[:, real:real + 1] = data_page.reshape(2, 1, L, ps, H, D)


class FakeMLAHostPool:
    """SGLang's MLATokenToKVPoolHost: one latent (kv_lora_rank + rope dims) per token per layer."""

    def __init__(self, layout: str, page_size: int, pages: int = 8, layers: int = 3, kv_cache_dim: int = 24,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.page_size, self.dtype = layout, page_size, dtype
        self.layer_num, self.kv_cache_dim = layers, kv_cache_dim
        self.kv_lora_rank, self.qk_rope_head_dim = kv_cache_dim * 2 // 3, kv_cache_dim // 3
        self.page_num = pages
        self.size = pages * page_size
        dims = {
            "layer_first": (layers, self.size, 1, kv_cache_dim),
            "page_first": (self.size, layers, 1, kv_cache_dim),
            "page_first_direct": (pages, layers, page_size, 1, kv_cache_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index:index + self.page_size]
        else:
            real = index // self.page_size
            page = self.kv_buffer[real:real + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        ps, L, W = self.page_size, self.layer_num, self.kv_cache_dim
        if self.layout == "layer_first":
            self.kv_buffer[:, index:index + ps] = data_page.reshape(L, ps, 1, W)
        elif self.layout == "page_first":
            self.kv_buffer[index:index + ps] = data_page.reshape(ps, L, 1, W)
        else:
            real = index // ps
            self.kv_buffer[real:real + 1] = data_page.reshape(1, L, ps, 1, W)


def fill(pool: FakeMHAHostPool | FakeMLAHostPool, seed: int) -> None:
    """Random bytes in every slot of the pool (as if the device had backed them up)."""
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
