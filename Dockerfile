# imajev-serve on one NVIDIA GPU (falls back to the CPU when none is visible).
#
#   docker build -t imajev-serve .
#   docker run --gpus all -p 8765:8765 -v $PWD/models:/models imajev-serve \
#       serve --model /models/Qwen3.5-4B --adapter /models/imajev-4b \
#             --calibration /models/imajev-4b/calibration-rot4.json --host 0.0.0.0
#   docker run -p 8765:8765 imajev-serve serve --host 0.0.0.0      # the built-in demo, CPU
#
# The binary needs no CUDA toolkit to build: cudarc loads libcuda, NVRTC and cuBLASLt at run
# time, and the kernels are compiled by NVRTC at start (cached under /cache).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked && strip target/release/imajev-serve

FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04
# NVRTC compiles the kernels against the CUDA headers (cuda_bf16.h, cuda_fp8.h).
RUN apt-get update && apt-get install -y --no-install-recommends cuda-cudart-dev-13-0 curl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/imajev-serve /usr/local/bin/imajev-serve
ENV CUDA_HOME=/usr/local/cuda \
    IMAJEV_KERNEL_CACHE=/cache/kernels \
    IMAJEV_HOST=0.0.0.0 \
    IMAJEV_PORT=8765
VOLUME ["/cache"]
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s CMD curl -fsS http://127.0.0.1:8765/healthz || exit 1
ENTRYPOINT ["imajev-serve"]
CMD ["serve"]
