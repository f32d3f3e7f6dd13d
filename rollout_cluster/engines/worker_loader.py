"""TensorLoader: the vLLM worker extension (engine arg `worker_extension_cls`, through
weight_keep.SwapLoader) that loads named tensors into the running model in place. vLLM mixes it
into its worker class, so its methods run inside the worker, reached with `collective_rpc`.

The load: on vLLM-CPU with an unquantized model, direct_load.py's DirectLoad (the model's own
`load_weights` into the live parameters, each linear layer repacked for oneDNN once complete;
experiments/weights-sync/README.md). Otherwise vLLM's own layerwise reload
(model_executor/model_loader/reload), what `reload_weights(weights_path=...)` runs over a
checkpoint's tensors: `initialize_layerwise_reload` once, `model.load_weights(bucket)` per bucket
(it fuses q/k/v and gate/up, shards for tensor parallelism, and processes each layer as soon as
all its tensors arrived), `finalize_layerwise_reload` once. Either way a layer's tensors may lie
in different buckets. Buckets come from a /dev/shm slot or file, as bytes, from Ray's object
store where they lie (store_views.py), or (pushed by CUDA IPC, transfer/ipc.py) as handles the
worker opens on its own GPU. A GPU worker first copies a host bucket to its GPU through a
page-locked ring (device_staging.py; a 7B model's load 0.65-0.78 s on an H100 against 2.0-2.1 s with
vLLM's own copies from pageable memory), and the loaders copy on the device.
"""
from __future__ import annotations

import os

from ..transfer.trace import mark
from .bucket_files import as_uint8, map_shm, unpack_bucket

LOAD_ENV = "ROLLOUT_TENSOR_LOAD"  # "direct" (default: direct_load.py where supported) or "layerwise" (vLLM's reload)


class TensorLoader:
    """vLLM worker extension: loads named tensors into the running model in place.

    The methods run inside vLLM's worker (self is the worker: model_runner, vllm_config). Their
    names carry the prefix `rc_` because vLLM refuses an extension whose names its worker has.
    A session: rc_tensors_begin(), rc_tensors_load(...) per bucket, rc_tensors_end(). Nothing
    else may run meanwhile (the replica loads between batches). If a load fails, rc_tensors_end
    still takes the model out of the reload (layers that got nothing keep their weights, the
    others have new ones): the model runs again, with weights of unknown mix."""

    def _rc_model(self):
        return self.model_runner.get_model()

    def rc_tensors_begin(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from .direct_load import DirectLoad, supported

        model = self._rc_model()
        self._rc_sessions = getattr(self, "_rc_sessions", 0) + 1  # loads begun in this worker
        self._rc_on_gpu = 0  # buckets of this load staged on the GPU (_rc_on_device)
        self._rc_stage_off = False  # staging failed in this load: its other buckets are not staged
        self._rc_expected = {n for n, _ in model.named_parameters()}
        self._rc_loaded = set()
        self._rc_direct = None
        with set_current_vllm_config(self.vllm_config):
            if os.environ.get(LOAD_ENV, "direct") == "direct" and supported(model):
                self._rc_pool = getattr(self, "_rc_pool", [])  # scratch kept from one load to the next
                self._rc_direct = DirectLoad(model, self._rc_pool)
                self._rc_mode = "direct"
            else:
                initialize_layerwise_reload(model)
                self._rc_mode = "layerwise"

    def rc_reload_format(self, fmt: str) -> str:
        """Have vLLM's reload_weights read checkpoints as `fmt`: an engine started with load_format
        dummy has a loader that reads no file, so reload_weights refused ("Model reloading with
        `dummy` format"). Returns the format it had."""
        config = self.vllm_config.load_config
        old, config.load_format = config.load_format, fmt
        return old

    def rc_tensors_mode(self) -> str | None:
        """How the last load ran: "direct" (direct_load.py) or "layerwise" (vLLM's reload)."""
        return getattr(self, "_rc_mode", None)

    def rc_map_region(self, region: dict) -> str | None:
        """Map a region of Ray's object store (store_views.py) and keep it under region["key"];
        returns why it cannot (the replica then copies into slots), or None."""
        from .store_views import open_region

        maps = self.__dict__.setdefault("_rc_regions", {})  # region key -> its mapping
        if region["key"] not in maps:
            try:
                maps[region["key"]] = open_region(region)
            except (OSError, ValueError) as e:
                return f"{type(e).__name__}: {e}"
        return None

    def rc_tensors_load(self, header: dict, path: str | None = None, data: bytes | None = None,
                        slot: tuple | None = None, region: str | None = None) -> int:
        """Load one packed bucket, from the /dev/shm file `path`, from `data`, from the slot
        (id, size) (shm_slots.py: mapped from `path` the first time, kept mapped), or from the
        object-store region `region` mapped by rc_map_region (the header's offsets are in it).
        Returns the number of tensors."""
        mark("worker_load_start", bytes=header["nbytes"])
        if region is not None:
            buf = self.__dict__.get("_rc_regions", {}).get(region)
            if buf is None:
                raise KeyError(f"object-store region {region}: not mapped in this worker (rc_map_region first)")
        elif slot is not None:
            maps = self.__dict__.setdefault("_rc_slots", {})  # slot id -> its mapping
            if slot[0] not in maps:
                # torch.from_file would make a new file of zeros where the slot's is gone (unlinked
                # once a worker mapped it): refuse instead of loading zeros
                if path is None or not os.path.exists(path):
                    raise FileNotFoundError(f"shm slot {slot[0]}: not mapped in this worker and its file "
                                            f"{path!r} is gone")
                maps[slot[0]] = map_shm(path, slot[1])
            buf = maps[slot[0]]
        else:
            buf = map_shm(path, header["nbytes"]) if path is not None else data
        staged = self._rc_on_device(header, buf)
        if staged is not None:
            pairs, moved = staged
            n = self._rc_load(pairs)
            if self._rc_direct is None:  # (kept views would hold the whole GPU copy until their layer completes)
                _copy_kept_views(moved)
        else:
            n = self._rc_load(unpack_bucket(header, buf))
            if (slot is not None or region is not None) and self._rc_direct is None:
                _copy_kept_views(buf)
        mark("worker_load_end")
        return n

    def _rc_on_device(self, header: dict, buf) -> tuple | None:
        """(the bucket's tensors as views of one copy of its bytes on this worker's GPU, that copy),
        made through the worker's page-locked ring (device_staging.py); None where the loaders read
        the host bytes themselves: not a CUDA worker, vLLM-CPU's direct load, a parallel engine,
        ROLLOUT_DEVICE_STAGING=0, or not enough GPU memory for the copy (then not again in this load;
        said once)."""
        import torch

        from .device_staging import ENV, bucket_span, rebased, room_for, wanted

        dev, env = getattr(self, "device", None), os.environ.get(ENV)
        if env == "alternate":  # (a benchmark's A/B: every other load staged, the first one too)
            env = "1" if getattr(self, "_rc_sessions", 1) % 2 else "0"
        world = getattr(getattr(self.vllm_config, "parallel_config", None), "world_size", 1)
        if not wanted(dev, self._rc_direct is not None, env, world) or getattr(self, "_rc_stage_off", False):
            return None
        staging = self._rc_ring(dev)
        if staging is None:
            return None
        lo, hi = bucket_span(header)
        try:
            if not room_for(hi - lo, dev):
                raise torch.OutOfMemoryError(f"{hi - lo} bytes and a margin are not free")
            mark("worker_stage_start", bytes=hi - lo, threads=staging.threads, torch_threads=torch.get_num_threads())
            moved = staging.to_device(as_uint8(buf)[lo:hi])
            mark("worker_stage_end")
        except torch.OutOfMemoryError as e:
            self._rc_stage_off = True  # (the rest of this load: each try would sync and empty the cache)
            _say_once(self, "_rc_said_room", "a pushed bucket's %d bytes found no room on the GPU (%s): this load's "
                      "buckets go to vLLM's loaders from host memory", hi - lo, e)
            return None
        self._rc_on_gpu = getattr(self, "_rc_on_gpu", 0) + 1
        return unpack_bucket(rebased(header, lo), moved), moved

    def _rc_ring(self, dev):
        """This worker's DeviceStaging, made at its first staged bucket; None for good where its
        page-locked memory was refused (said once). A ROLLOUT_STAGING_THREADS that is no number of
        threads is said once, and the default used."""
        from .device_staging import DeviceStaging, copy_threads

        ring = self.__dict__.get("_rc_device_staging")
        if ring is None:
            try:
                threads = copy_threads()
            except ValueError as e:
                threads = copy_threads(env="")
                _say_once(self, "_rc_said_threads", "%s: the ring copies on %d threads", e, threads)
            try:
                ring = DeviceStaging(dev, threads=threads)
            except RuntimeError as e:
                ring = False
                _say_once(self, "_rc_said_ring", "no page-locked ring for pushed buckets (%s): they go to vLLM's "
                          "loaders from host memory", e)
            self._rc_device_staging = ring
        return ring or None

    def rc_tensors_load_ipc(self, header: dict, handles: bytes) -> int:
        """Load one IPC bucket (transfer/ipc.py): its tensors rebuilt from the trainer's CUDA IPC
        handles on this worker's device (refused, naming both GPUs, where the trainer's is another),
        loaded as rc_tensors_load loads. Returns the number of tensors."""
        import torch

        from ..transfer.ipc import device_uuid, open_handles

        mark("worker_load_start", bytes=header["nbytes"])
        dev = getattr(self, "device", None)
        index = dev.index if isinstance(dev, torch.device) and dev.type == "cuda" else torch.cuda.current_device()
        self._rc_ipc = index  # rc_tensors_end synchronizes it too (the reload may read a kept tensor there)
        weights = open_handles(header, handles, index, device_uuid(index))
        n = self._rc_load(weights)
        # the copies out of the trainer's memory finish before it may change or free it
        torch.cuda.synchronize(index)
        del weights
        mark("worker_load_end")
        return n

    def _rc_load(self, weights: list) -> int:
        import torch
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if self._rc_direct is not None:
                loaded = self._rc_direct.load(weights)
            else:
                loaded = self._rc_model().load_weights(weights)
        self._rc_loaded |= set(loaded or ())
        return len(weights)

    def rc_tensors_end(self, keep_slots: list | None = None, keep_regions: list | None = None) -> list:
        """Finish the session: process what is left (attention layers), put back the weights of
        layers that got no tensor, unmap the slots not in `keep_slots` and the object-store regions
        not in `keep_regions` (None: keep every region). Returns the model's parameters that got none."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        import torch

        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                direct, self._rc_direct = getattr(self, "_rc_direct", None), None
                if direct is not None:
                    # a layer no tensor reached although its names were loaded would be a loader
                    # that did nothing: report its parameters as missing
                    for layer in direct.finish() or ():
                        self._rc_loaded -= {n for n in self._rc_loaded if n.startswith(layer + ".")}
                else:
                    finalize_layerwise_reload(self._rc_model(), self.vllm_config.model_config)
        finally:
            # vLLM's reload keeps an incomplete layer's tensors and processes what is left here: after
            # an IPC load, its copies out of the trainer's memory finish before the lease goes
            ipc, self._rc_ipc = getattr(self, "_rc_ipc", None), None
            if ipc is not None:
                torch.cuda.synchronize(ipc)
            if getattr(self, "_rc_on_gpu", 0):  # the buckets' GPU copies go back to the device, not
                torch.cuda.empty_cache()  # kept in torch's cache (a co-located process may want them)
        maps = getattr(self, "_rc_slots", {})
        for sid in [k for k in maps if k not in (keep_slots or ())]:
            del maps[sid]
        regions = getattr(self, "_rc_regions", {})
        for key in [k for k in regions if keep_regions is not None and k not in keep_regions]:
            del regions[key]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        return sorted(getattr(self, "_rc_expected", set()) - getattr(self, "_rc_loaded", set()))


def _say_once(worker, flag: str, msg: str, *args) -> None:
    if not getattr(worker, flag, False):
        setattr(worker, flag, True)
        import logging

        logging.getLogger(__name__).warning(msg, *args)


def _copy_kept_views(buf) -> None:
    """vLLM's layerwise reload keeps the tensors of a layer whose other tensors have not arrived
    yet (and of a padded layer, until rc_tensors_end): views of `buf`, a shm slot the replica
    writes another bucket into once this call returned (or an object-store region, whose object
    the replica lets go then; or a bucket's copy on the GPU, device_staging.py, which would stay
    whole while one view of it is kept). Each such tensor becomes a copy of its own."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    lo = buf.data_ptr()
    hi = lo + buf.numel() * buf.element_size()
    for info in list(LAYERWISE_INFO.values()):
        for _, args in info.loaded_weights:
            for key, value in args.arguments.items():
                if (isinstance(value, torch.Tensor) and value.device == buf.device and value.numel()
                        and lo <= value.data_ptr() < hi):
                    args.arguments[key] = value.clone()
