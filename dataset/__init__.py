"""The one episode/dataset format every layer shares (simulated demos, recorded robot episodes,
debugging traces). It sits at the ground next to ``envs`` so that ``train`` and ``deploy`` both
read and write it without importing each other; the HDF5 layout (with its checksums and layout
digests, and the per-episode journal a killed writer's episodes are recovered from) is documented in
:mod:`dataset.hdf5`, the locks and disk-full errors every writer shares in :mod:`dataset.files`.
LeRobotDatasets (v3.0, v2.1) are read as the same episodes and written from them by :mod:`dataset.lerobot`;
:func:`open_dataset` picks the reader for a ``--data`` path (``lerobot:DIR`` or an HDF5 file)."""

from dataset.files import DiskFullError, InUseError
from dataset.hdf5 import FORMAT, VERSION, Dataset, DatasetError, DatasetWriter, Episode, EpisodeBuffer
from dataset.lerobot import LeRobotExport, LeRobotFeatures, LeRobotReader, open_dataset, write_lerobot

__all__ = ["FORMAT", "VERSION", "Dataset", "DatasetError", "DatasetWriter", "DiskFullError", "Episode",
           "EpisodeBuffer", "InUseError", "LeRobotExport", "LeRobotFeatures", "LeRobotReader", "open_dataset",
           "write_lerobot"]
