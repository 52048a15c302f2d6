# imajev-serve on one NVIDIA GPU: the released imajev-4b (Qwen3.5-4B with the imajev LoRA and
# readout, FP8 projections, 4 rotations, calibration-rot4.json) from the folder mounted at /models.
#
#   docker build --build-arg IMAJEV_GIT_COMMIT="$(git rev-parse --short=12 HEAD)" -t imajev-serve .
#   docker run --gpus all --stop-timeout 30 -p 8765:8765 -v "$PWD/models:/models:ro" \
#     -v imajev-cache:/home/imajev/.cache imajev-serve
#   docker run --rm -p 8765:8765 imajev-serve serve --demo
#
# (the README's Docker section, word for word: tests/readme.rs keeps them equal; the last command
# serves the random-weight demo on the CPU, the API only)
#
# * runtime/serve.env holds the released flags; runtime/entrypoint.sh applies those not set with
#   `-e` (never to --demo), runs `imajev-serve verify` first when a hash lock exists
#   (adapter/release.lock.json, or $IMAJEV_LOCK), then execs the server as PID 1.
# * An empty or missing /models stops the container with the download commands.
# * --stop-timeout 30: on SIGTERM the server finishes accepted requests for up to its
#   --shutdown-grace (25 s), then exits; Docker's default of 10 s would cut them off.
# * The NVRTC kernel cache is ~/.cache/imajev-serve/kernels of the user imajev; the named volume
#   keeps it across `--rm` runs (a first start compiles the kernels).
# * The binary needs no CUDA toolkit to build: cudarc loads libcuda, NVRTC and cuBLASLt at run time.
# * Bases are pinned by digest (renew with `docker buildx imagetools inspect IMAGE:TAG`); the
#   cudart headers match the CUDA 13.0.2 runtime of the base.

FROM rust:1.95-bookworm@sha256:6258907abe69656e41cd992e0b705cdcfabcbbe3db374f92ed2d47121282d4a1 AS build
# nasm: mozjpeg builds libjpeg-turbo's SIMD decoders with it (without it they are silently left out).
RUN apt-get update \
    && apt-get install -y --no-install-recommends nasm=2.16.01-1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# build.rs reads it for --version (the build context has no .git).
ARG IMAJEV_GIT_COMMIT=unknown
RUN cargo build --release --locked && strip target/release/imajev-serve

FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2
# NVRTC compiles the kernels at start against the CUDA headers (cuda_bf16.h, cuda_fp8.h).
RUN apt-get update \
    && apt-get install -y --no-install-recommends cuda-cudart-dev-13-0=13.0.96-1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin imajev \
    && install -d -o imajev -g imajev /home/imajev/.cache /home/imajev/.cache/imajev-serve \
    && install -d /models
COPY --from=build /src/target/release/imajev-serve /usr/local/bin/imajev-serve
COPY adapter/ /opt/imajev-serve/adapter/
COPY runtime/ /opt/imajev-serve/runtime/
ENV CUDA_HOME=/usr/local/cuda \
    HOME=/home/imajev \
    IMAJEV_HOST=0.0.0.0 \
    IMAJEV_PORT=8765
# The user imajev, by number (so a runtime that requires a non-root user can tell).
USER 10001:10001
WORKDIR /home/imajev
EXPOSE 8765
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["/opt/imajev-serve/runtime/healthcheck.sh"]
ENTRYPOINT ["/opt/imajev-serve/runtime/entrypoint.sh"]
CMD ["serve"]
