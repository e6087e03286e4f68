"""The `disk` and `distributed` transports in delta mode (`--update-weight-mode delta`).

Each keeps a `DeltaBase` and, per sync, sends either the full weights (recording them as
the new base) or, bucket by bucket, the compressed XOR against the base:

  disk         a delta directory `weights-<version>.delta/` beside the full checkpoints,
               one sub-directory per bucket (its manifest and file, written to a
               temporary sibling and renamed into place), each loaded by its own
               `update_weights_from_disk` with `load_format="xor_zstd"` as soon as it is
               written (the engine applies bucket k while the trainer encodes k+1)
  distributed  per bucket an `update_weights_from_distributed` request with
               `load_format="xor_zstd"` and the bucket's `weight_delta` header, then one
               broadcast of its compressed bytes over the weight group

A full sync in delta mode packs each bucket on the host (the base lives there), so it
moves the same bytes as the plain transports with one host copy more.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from slime_like.engine.session import EngineSession
from slime_like.errors import WeightSyncError
from slime_like.protocol import io_struct as p
from slime_like.protocol import weight_delta as wd
from slime_like.protocol.buckets import Bucket
from slime_like.protocol.modes import Transport
from slime_like.weights.delta import DeltaBase, host_bytes, host_pieces
from slime_like.weights.disk import DiskTransport, _safe_version
from slime_like.weights.distributed import FLATTENED, DistributedTransport
from slime_like.weights.packing import WeightSource, bucket_tensors, metas_body
from slime_like.weights.sync_config import WeightSyncConfig
from slime_like.weights.transport import Payload, TransferStats
from slime_like.weights.watch import Watch


def _why_full(base: DeltaBase, engines: Sequence[EngineSession], buckets: Sequence[Bucket],
              source: WeightSource) -> str | None:
    if getattr(source, "buckets_in_wire_layout", False):
        return "a sharded source (gathered straight into the wire layout) is sent in full"
    return base.full_reason(engines, buckets)


class _KeepsDeltaBase:
    """What both delta transports do with their base: made with the transport, forgotten
    for engines that left, invalid after a failed sync, released at close."""

    base: DeltaBase

    def __init__(self, *, full_every: int, **kwargs):
        super().__init__(**kwargs)
        self.base = DeltaBase(full_every)

    def failed(self) -> None:
        super().failed()
        self.base.invalidate()

    def forget(self, urls: Sequence[str]) -> None:
        super().forget(urls)
        self.base.forget(urls)

    def close(self, engines: Sequence[EngineSession]) -> None:
        super().close(engines)
        self.base.release()


class DeltaDiskTransport(_KeepsDeltaBase, DiskTransport):
    """`disk`, sending a delta directory when every engine holds the base."""

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        reason = _why_full(self.base, engines, buckets, source)
        self.base.start(buckets, reason)
        if reason:
            yield from super().payloads(engines, source, buckets, version, watch, stats)
            t0 = time.perf_counter()  # the checkpoint is written: read it back as the base
            src = iter(source.tensors())
            for k, bucket in enumerate(buckets):
                self.base.record(k, host_bytes(bucket_tensors(src, bucket)))
            stats.pack_s += time.perf_counter() - t0
        else:
            yield from self._delta_payloads(source, buckets, version, stats)
        stats.delta = self.base.outcome.as_dict()
        self.base.landed(engines, version)

    def _delta_payloads(self, source: WeightSource, buckets: Sequence[Bucket], version: str,
                        stats: TransferStats) -> Iterator[Payload]:
        """One sub-directory and one request per bucket, each yielded once written: the
        engine loads bucket k while this process encodes bucket k+1."""
        out = self.directory / f"weights-{_safe_version(version)}.delta"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        self._keep(out)
        base_version, src = self.base.version, iter(source.tensors())
        for k, bucket in enumerate(buckets):
            t0 = time.perf_counter()
            done = out / f"{k:05d}"
            tmp = out / f".{k:05d}.tmp-{os.getpid()}"
            tmp.mkdir()
            name = "bucket.xor.zst"
            with open(tmp / name, "wb") as sink:  # zstd writes each piece as it compresses
                header = self.base.encode(k, host_pieces(bucket_tensors(src, bucket)), sink)
            manifest = wd.DeltaManifest(base_version=base_version, version=version, buckets=[
                wd.DeltaBucketFile(file=name, header=header, **metas_body(bucket.metas))])
            (tmp / wd.MANIFEST).write_text(json.dumps(manifest.model_dump()))
            os.replace(tmp, done)
            stats.pack_s += time.perf_counter() - t0  # "pack" = encoding and writing the delta
            stats.bytes += header.encoded_nbytes
            stats.buckets += 1
            yield self._bucket_payload(done, k, len(buckets), header.encoded_nbytes)

    @staticmethod
    def _bucket_payload(path: Path, k: int, count: int, nbytes: int) -> Payload:
        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromDiskRequest(model_path=str(path), load_format=wd.XOR_ZSTD,
                                                  flush_cache=flush, weight_version=version)

        return Payload(f"update_weights_from_disk (delta bucket {k + 1}/{count})",
                       "update_weights_from_disk", request, nbytes, last=k == count - 1)

    def _keep(self, out: Path) -> None:
        """The newest full checkpoint stays (the deltas' first base), and `keep` deltas."""
        if out in self.written:
            self.written.remove(out)
        self.written.append(out)
        fulls = [d for d in self.written if not d.name.endswith(".delta")]
        deltas = [d for d in self.written if d.name.endswith(".delta")]
        for d in fulls[:-1] + deltas[:-self.keep]:
            shutil.rmtree(d, ignore_errors=True)
            self.written.remove(d)



class DeltaDistributedTransport(_KeepsDeltaBase, DistributedTransport):
    """`distributed`, broadcasting compressed delta buckets when every engine holds the base."""

    def payloads(self, engines: Sequence[EngineSession], source: WeightSource,
                 buckets: Sequence[Bucket], version: str, watch: Watch, stats: TransferStats
                 ) -> Iterator[Payload]:
        old = [e.url for e in engines if not e.has_flattened_distributed]
        if old or self.load_format != FLATTENED or getattr(source, "buckets_in_wire_layout",
                                                           False):
            # per-tensor broadcasts and sharded sources carry no delta: full, no base kept
            self.base.release()
            yield from super().payloads(engines, source, buckets, version, watch, stats)
            return
        if self.pg is None or self.members != tuple((e.url, e.tp_size) for e in engines):
            raise WeightSyncError("transfer", "the weight group does not match the engines; "
                                  "attach before transferring")
        reason = self.base.full_reason(engines, buckets)
        self.base.start(buckets, reason)
        yield from self._buckets(source, buckets, watch, stats, full=reason is not None)
        stats.delta = self.base.outcome.as_dict()
        self.base.landed(engines, version)

    def _buckets(self, source: WeightSource, buckets: Sequence[Bucket], watch: Watch,
                 stats: TransferStats, full: bool) -> Iterator[Payload]:
        """Full or delta, bucket by bucket: packed on the host, then one broadcast each; at
        most two broadcasts in flight (their buffers are the only copies kept)."""
        src = iter(source.tensors())
        works: list = []
        for k, bucket in enumerate(buckets):
            t0 = time.perf_counter()
            tensors = bucket_tensors(src, bucket)
            if full:
                new = host_bytes(tensors)
                self.base.record(k, new)
                buf, header, fmt = torch.from_numpy(new), None, FLATTENED
            else:
                sink = io.BytesIO()
                header = self.base.encode(k, host_pieces(tensors), sink)
                # the tensor holds the BytesIO's buffer alive: no copy of the compressed bytes
                buf, fmt = torch.frombuffer(sink.getbuffer(), dtype=torch.uint8), wd.XOR_ZSTD
            buf = buf.to(self.device)
            stats.pack_s += time.perf_counter() - t0
            yield self._delta_payload(k, len(buckets), bucket, fmt, header)
            works.append((self._broadcast(buf, None), buf))  # after .to(): same stream
            stats.bytes += buf.numel()
            stats.buckets += 1
            if len(works) > 2:
                self._drain(watch, stats, works[:-2])
                works = works[-2:]
        self._drain(watch, stats, works)

    def _delta_payload(self, k: int, count: int, bucket: Bucket, fmt: str,
                       header: wd.DeltaHeader | None) -> Payload:
        body, group = metas_body(bucket.metas), self.group_name

        def request(engine: EngineSession, flush: bool, version: str | None):
            return p.UpdateWeightsFromDistributedRequest(
                **body, group_name=group, flush_cache=flush, weight_version=version,
                load_format=fmt, weight_delta=header)

        what = "delta bucket" if header is not None else "bucket"
        return Payload(f"update_weights_from_distributed ({what} {k + 1}/{count})",
                       "update_weights_from_distributed", request,
                       header.encoded_nbytes if header is not None else bucket.nbytes,
                       last=k == count - 1)

def make_delta_transport(config: WeightSyncConfig, device: torch.device
                         ) -> DeltaDiskTransport | DeltaDistributedTransport:
    """The delta transport the settings name (`disk` or `distributed`; checked by the config)."""
    every = int(config.update_weight_delta_full_every)
    if config.transport is Transport.DISTRIBUTED:
        return DeltaDistributedTransport(
            full_every=every, device=device,
            bucket_bytes=int(config.update_weight_buffer_size), load_format=config.load_format,
            backend=config.backend, master_address=config.master_address,
            master_port=config.master_port, group_timeout_s=config.group_timeout_s)
    return DeltaDiskTransport(full_every=every, directory=config.disk_dir,
                              model_dir=config.model_dir)
