"""A CPU-safe variant of vLLM's hidden-states connector, loaded by module path.

vLLM's `ExampleHiddenStatesConnector` (with the `extract_hidden_states` speculative method) keeps
the tapped layers' hidden states of every token in a cache-only KV group and, when a request
finishes, copies that request's slots to a safetensors file. Its copy uses CUDA streams, CUDA events
and pinned memory, which fail on a CPU build after the first request (docs/vllm.md). This
subclass replaces only that copy: it gathers the slots and writes the file synchronously (temp file
renamed into place by storage/atomic.py, so a file that exists is complete), and it honours one extra request parameter,
`kv_transfer_params["save_from"]`: the first token position to save. A rollout needs the states of
its last few tokens only, so writing its whole prompt again per anchor would cost O(anchors *
sequence length) disk traffic for nothing.

The engine imports this module by name in every worker (`kv_connector_module_path`), so it imports
vllm, torch and storage.atomic only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)

from storage.atomic import atomic_write

MODULE_PATH = __name__
CONNECTOR_NAME = "SyncHiddenStatesConnector"


@dataclass
class PartialSave(PendingSave):
    first_token: int = 0  # position of token_ids[0] within the request's tokens


class _Done:
    """Stands in for the CUDA event the parent polls: the write already happened."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    # ---- scheduler side: cut the saved range down to [save_from, end)

    def request_finished(self, request, block_ids):
        delay_free, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        save_from = int((request.kv_transfer_params or {}).get("save_from", 0))
        if pending is not None and save_from > 0:
            self._pending_saves[request.request_id] = PartialSave(
                req_id=pending.req_id,
                filename=pending.filename,
                token_ids=pending.token_ids[save_from:],
                block_ids=pending.block_ids,
                first_token=save_from,
            )
        return delay_free, params

    # ---- worker side: synchronous gather + write, no CUDA streams or pinned memory

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        first = getattr(pending, "first_token", 0)
        num_tokens = pending.token_ids.shape[0]
        # Token i of the request sits in block block_ids[i // block_size] at offset i % block_size;
        # plain slices of the (few) blocks involved, no gather over the whole cache.
        block_size = self._kv_cache.shape[2]  # cache view: [num_blocks, num_layers, block_size, H]
        pieces = []
        for position in range(first - first % block_size, first + num_tokens, block_size):
            lo = max(first, position) - position
            hi = min(first + num_tokens, position + block_size) - position
            block = pending.block_ids[position // block_size]
            pieces.append(self._kv_cache[block, :, lo:hi].transpose(0, 1))  # [n, num_layers, H]
        num_layers, hidden_size = self._kv_cache.shape[1], self._kv_cache.shape[3]
        hidden_states = torch.cat(pieces) if pieces else self._kv_cache.new_zeros((0, num_layers, hidden_size))
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        tensors = {"hidden_states": hidden_states.cpu().contiguous(), "token_ids": pending.token_ids.clone()}
        # A hand-off file the runner reads and deletes at once: renamed whole, not fsynced.
        atomic_write(pending.filename, lambda tmp: save_file(tensors, tmp), sync=False)
        # The parent's get_finished reports a request as sent once its "copy event" is done.
        self._req_copy_events[pending.req_id] = _Done()
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)
