"""GPU and one-host device work: the BLAKE3 kernels (``devhash.py``, ``devhash_kernels.py``), the GPU codec
(``gpucodec.py``, ``gpupayload.py``, ``plane_kernels.py``), CUDA IPC (``cuda_ipc.py``), and the one-host device
transfer built on them: the landing (``landing.py``, its lend pass ``lend.py``) and the sender (``sender.py``),
which share ``channel.py``. Nothing here imports torch until a module that needs it is imported.
"""
