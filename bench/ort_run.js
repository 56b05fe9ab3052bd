// Runs one ONNX model once with onnxruntime-node, for bench/precision_error.py: reads the input
// `x` [B, L, E] as raw little-endian float32 from IN, writes the output `y` (float32, raw) to OUT.
// One intra-op thread, all graph optimisations (as bench/compare_ort.py makes its sessions).
//
//   ORT_NODE=/tmp/ort/node_modules/onnxruntime-node node bench/ort_run.js MODEL.onnx IN OUT B L E
const fs = require('fs');
const ort = require(process.env.ORT_NODE || 'onnxruntime-node');

async function main() {
  const [model, inPath, outPath] = process.argv.slice(2, 5);
  const dims = process.argv.slice(5, 8).map(Number);
  const x = new Float32Array(new Uint8Array(fs.readFileSync(inPath)).buffer);  // copied: aligned
  const session = await ort.InferenceSession.create(model, {
    intraOpNumThreads: 1, interOpNumThreads: 1, graphOptimizationLevel: 'all',
    executionMode: 'sequential'});
  const {y} = await session.run({x: new ort.Tensor('float32', x, dims)});
  fs.writeFileSync(outPath, Buffer.from(y.data.buffer, y.data.byteOffset, y.data.byteLength));
}

main().catch(e => { console.error(e.message); process.exit(1); });
