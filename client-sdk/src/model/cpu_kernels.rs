//! Training kernels for the flex CPU backend where burn's generic paths are slow: convolution as
//! matrix multiplies over the input's patches, a 2×2 max-pool fused with the ReLU beside it, each
//! with its own backward pass, and an SGD step in place.
//!
//! flex convolves directly forward, takes the input gradient by a transposed convolution and the
//! weight gradient by convolving the input with the output gradient; it pools through its general
//! 3-D pooling (i64 index tensors, a strided walk per window), and a ReLU is two more passes over
//! the same activations. Here a convolution with stride 1 is, per group of images, one multiply
//! of the kernels by the patches forward and one for each gradient; the patches are gathered
//! again in the backward pass rather than kept, so memory stays at one group's patches. A 2×2
//! pool with stride 2 is one pass each way and keeps no indices: the backward pass finds each
//! window's maximum again by comparing the input with the output it kept.
//!
//! The operations are a burn backend extension: flex runs the kernels below, burn's autodiff
//! wraps them with the backward passes written here. Other backends (wgpu) keep burn's own
//! layers; [`flex_trains`] is what the model asks before taking these paths.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    AutodiffBackend, Backend, DispatchDevice, Flex, TensorMetadata, backend_extension,
};
use burn::tensor::{DType, Device, Shape, Slice, Tensor, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

/// The kernels, per backend: flex's below, autodiff's wrapping them.
#[backend_extension(Flex, Autodiff)]
pub trait CpuTrainOps: Backend {
    /// 2×2 max-pool with stride 2 over `[batch, channels, height, width]` (an odd last row or
    /// column is dropped, as burn's pool does), then ReLU when `relu`.
    fn max_pool_2x2(x: FloatTensor<Self>, relu: bool) -> FloatTensor<Self>;

    /// The gradient of [`CpuTrainOps::max_pool_2x2`] with respect to its input `x`, given the
    /// output `pooled` it gave and the output's gradient: each window's gradient goes to the
    /// first of its four inputs equal to the window's output, none where ReLU cut the output to 0.
    fn max_pool_2x2_backward(
        x: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        relu: bool,
    ) -> FloatTensor<Self>;

    /// A convolution of `x` `[batch, channels, h, w]` with `kernels` `[out, channels, k, k]`,
    /// stride 1, `padding` zeros on every side, no bias: `[batch, out, h', w']`. Per group of
    /// images, the kernels as one `[out, channels·k·k]` matrix times each image's patches.
    fn conv2d_by_patches(
        x: FloatTensor<Self>,
        kernels: FloatTensor<Self>,
        padding: usize,
    ) -> FloatTensor<Self> {
        let [o, c, k, _] = kernels.shape().dims::<4>();
        let kernels = Self::float_reshape(kernels, Shape::new([1, o, c * k * k]));
        conv2d_by_groups::<Self>(&x, &kernels, padding)
    }

    /// One step of plain SGD, `param - lr · grad`, in place where flex holds the only reference
    /// to `param`: one pass over both instead of two, and no new tensor the size of the model.
    fn sgd_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, lr: f64) -> FloatTensor<Self> {
        Self::float_sub(param, Self::float_mul_scalar(grad, lr.into()))
    }

    /// The patches a `k`×`k` kernel with stride 1 sees in `x` `[batch, channels, height, width]`
    /// padded with `padding` zeros: `[batch, channels·k·k, height'·width']`, per image one row per
    /// (channel, kernel row, kernel column) and one column per (output row, output column).
    fn patches(x: FloatTensor<Self>, k: usize, padding: usize) -> FloatTensor<Self>;

    /// The inverse gather of [`CpuTrainOps::patches`]: each patch entry added back to the input
    /// position it came from, `[batch, channels, height, width]` for `dims`. The input gradient
    /// of a convolution, given its patches' gradient.
    fn add_patches(
        patches: FloatTensor<Self>,
        dims: [usize; 4],
        k: usize,
        padding: usize,
    ) -> FloatTensor<Self>;
}

/// Most bytes of patches gathered at once: a group of images whose patches stay in the cores'
/// caches between being gathered and multiplied. Gathering the whole batch's at once (40 MB for
/// the FedAvg CNN's second layer at B = 64) made the layer memory-bound: 2.4× slower.
const GROUP_PATCH_BYTES: usize = 2 << 20;

/// The batch split into consecutive groups of images whose patches (`patch_values` f32 per
/// image) fit [`GROUP_PATCH_BYTES`], of at least four images: flex multiplies a batch of
/// matrices across its threads from four on, and one matrix at a time below that. What is left
/// over joins the last group (B = 10 in fours: 4 and 6, not 4, 4 and 2).
fn image_groups(batch: usize, patch_values: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    const MIN_GROUP: usize = 4;
    let per_group = (GROUP_PATCH_BYTES / (patch_values * size_of::<f32>()).max(1)).max(MIN_GROUP);
    let groups = (batch / per_group).max(1);
    (0..groups)
        .map(move |g| g * per_group..if g + 1 == groups { batch } else { (g + 1) * per_group })
}

/// Images `images` of a `[batch, ...]` tensor (a view, not a copy, on flex).
fn images_of<B: Backend>(x: &FloatTensor<B>, images: std::ops::Range<usize>) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    let mut slices = vec![Slice::full(); rank];
    slices[0] = Slice::from(images);
    B::float_slice(x.clone(), &slices)
}

/// [`CpuTrainOps::conv2d_by_patches`] with the kernels as `[1, out, channels·k·k]`, a group of
/// images at a time. The patches are dropped: the backward pass gathers them again, group by
/// group. Keeping them (6 MB at B = 10 in the FedAvg CNN's second layer) saved that gather but
/// made the first epoch up to 25 % slower, the allocator faulting in fresh memory for them.
fn conv2d_by_groups<B: CpuTrainOps>(
    x: &FloatTensor<B>,
    kernels: &FloatTensor<B>,
    padding: usize,
) -> FloatTensor<B> {
    let [b, c, h, w] = x.shape().dims::<4>();
    let [_, o, ckk] = kernels.shape().dims::<3>();
    let k = (ckk / c).isqrt();
    let (ho, wo) = output_size([h, w], k, padding);
    let outs = image_groups(b, ckk * ho * wo)
        .map(|images| {
            let patches = B::patches(images_of::<B>(x, images), k, padding);
            B::float_matmul(kernels.clone(), patches)
        })
        .collect();
    B::float_reshape(B::float_cat(outs, 0), Shape::new([b, o, ho, wo]))
}

/// The gradients of [`CpuTrainOps::conv2d_by_patches`]: for the input (when `input` is asked
/// for) and for the kernels (when `kernels_grad` is), from the output's gradient `grad`, the
/// input `x` and the kernels as `[1, out, channels·k·k]`. Group by group, as the forward pass.
fn conv2d_by_patches_backward<B: CpuTrainOps>(
    x: &FloatTensor<B>,
    kernels: &FloatTensor<B>,
    grad: FloatTensor<B>,
    padding: usize,
    [input, kernels_grad]: [bool; 2],
) -> (Option<FloatTensor<B>>, Option<FloatTensor<B>>) {
    let [b, c, h, w] = x.shape().dims::<4>();
    let [_, o, ckk] = kernels.shape().dims::<3>();
    let k = (ckk / c).isqrt();
    let [_, _, ho, wo] = grad.shape().dims::<4>();
    let grad = B::float_reshape(grad, Shape::new([b, o, ho * wo]));
    let kernels_t = B::float_swap_dims(kernels.clone(), 1, 2);
    let (mut dx, mut dk) = (Vec::new(), None);
    for images in image_groups(b, ckk * ho * wo) {
        let g = images.len();
        let grad = images_of::<B>(&grad, images.clone());
        if kernels_grad {
            let patches = B::patches(images_of::<B>(x, images), k, padding);
            // [channels·k·k, out] per image: the patches as the long side multiply faster.
            let per_image = B::float_matmul(patches, B::float_swap_dims(grad.clone(), 1, 2));
            let sum = B::float_sum_dim(per_image, 0);
            dk = Some(match dk {
                Some(dk) => B::float_add(dk, sum),
                None => sum,
            });
        }
        if input {
            let dpatches = B::float_matmul(kernels_t.clone(), grad);
            dx.push(B::add_patches(dpatches, [g, c, h, w], k, padding));
        }
    }
    let dk = dk.map(|dk| {
        let dk = B::float_swap_dims(B::float_reshape(dk, Shape::new([ckk, o])), 0, 1);
        B::float_reshape(dk, Shape::new([o, c, k, k]))
    });
    (input.then(|| B::float_cat(dx, 0)), dk)
}

/// Whether tensors on `device` train on flex, where these kernels run.
pub fn flex_trains(device: &Device) -> bool {
    matches!(device.clone().inner().as_dispatch(), DispatchDevice::Flex(_))
}

/// `relu(max_pool_2x2(x))` when `relu`, else the pool alone; see [`CpuTrainOps::max_pool_2x2`].
pub fn max_pool_2x2(x: Tensor<4>, relu: bool) -> Tensor<4> {
    Tensor::from_dispatch(<burn::backend::Dispatch as CpuTrainOps>::max_pool_2x2(
        x.into_dispatch(),
        relu,
    ))
}

/// Height and width of a stride-1 convolution's output.
fn output_size([h, w]: [usize; 2], k: usize, padding: usize) -> (usize, usize) {
    (h + 2 * padding + 1 - k, w + 2 * padding + 1 - k)
}

/// A flex tensor whose values `as_slice` gives as contiguous f32, and its dimensions: the tensor
/// itself where it already is (a group of images sliced from a batch is, at an offset), else a
/// contiguous copy.
fn values_of(t: &FlexTensor) -> (FlexTensor, [usize; 4]) {
    assert_eq!(t.dtype(), DType::F32, "the CPU training kernels take f32 tensors");
    let t = if t.as_slice::<f32>().is_some() { t.clone() } else { t.to_contiguous() };
    let dims = t.layout().shape().dims::<4>();
    (t, dims)
}

fn flex_tensor(values: Vec<f32>, dims: [usize; 4]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, Shape::new(dims)))
}

/// Parameters per rayon task in an SGD step.
const SGD_CHUNK: usize = 1 << 14;

/// Planes (and patch rows) per rayon task: enough work per task that scheduling stays small
/// beside it.
const MIN_PLANES_PER_TASK: usize = 8;
const MIN_ROWS_PER_TASK: usize = 32;

fn flex_max_pool_2x2(x: FlexTensor, relu: bool) -> FlexTensor {
    let (x, [b, c, h, w]) = values_of(&x);
    let xs: &[f32] = x.as_slice().expect("contiguous");
    let (ho, wo) = (h / 2, w / 2);
    let mut out = vec![0.0f32; b * c * ho * wo];
    if ho * wo > 0 {
        out.par_chunks_mut(ho * wo)
            .zip(xs.par_chunks(h * w))
            .with_min_len(MIN_PLANES_PER_TASK)
            .for_each(|(out, plane)| {
                for (i, out_row) in out.chunks_exact_mut(wo).enumerate() {
                    let top = &plane[2 * i * w..2 * i * w + 2 * wo];
                    let bottom = &plane[(2 * i + 1) * w..(2 * i + 1) * w + 2 * wo];
                    for ((o, t), u) in
                        out_row.iter_mut().zip(top.chunks_exact(2)).zip(bottom.chunks_exact(2))
                    {
                        let m = t[0].max(t[1]).max(u[0].max(u[1]));
                        *o = if relu { m.max(0.0) } else { m };
                    }
                }
            });
    }
    flex_tensor(out, [b, c, ho, wo])
}

fn flex_max_pool_2x2_backward(
    x: FlexTensor,
    pooled: FlexTensor,
    grad: FlexTensor,
    relu: bool,
) -> FlexTensor {
    let (x, [b, c, h, w]) = values_of(&x);
    let (pooled, [_, _, ho, wo]) = values_of(&pooled);
    let (grad, _) = values_of(&grad);
    let xs: &[f32] = x.as_slice().expect("contiguous");
    let ps: &[f32] = pooled.as_slice().expect("contiguous");
    let gs: &[f32] = grad.as_slice().expect("contiguous");
    let mut dx = vec![0.0f32; b * c * h * w];
    if ho * wo > 0 {
        dx.par_chunks_mut(h * w)
            .zip(xs.par_chunks(h * w))
            .zip(ps.par_chunks(ho * wo).zip(gs.par_chunks(ho * wo)))
            .with_min_len(MIN_PLANES_PER_TASK)
            .for_each(|((dx, plane), (pooled, grad))| {
                for i in 0..ho {
                    for j in 0..wo {
                        let (m, g) = (pooled[i * wo + j], grad[i * wo + j]);
                        if relu && m <= 0.0 {
                            continue;
                        }
                        let top = 2 * i * w + 2 * j;
                        let window = [top, top + 1, top + w, top + w + 1];
                        if let Some(&at) = window.iter().find(|&&at| plane[at] == m) {
                            dx[at] = g;
                        }
                    }
                }
            });
    }
    flex_tensor(dx, [b, c, h, w])
}

fn flex_sgd_step(mut param: FlexTensor, grad: FlexTensor, lr: f64) -> FlexTensor {
    assert_eq!(param.dtype(), DType::F32, "the CPU training kernels take f32 tensors");
    let grad = grad.to_contiguous();
    let gs: &[f32] = grad.as_slice().expect("contiguous");
    let lr = lr as f32;
    let whole = param.layout().contiguous_offsets() == Some((0, gs.len()));
    match param.try_storage_mut::<f32>().filter(|values| whole && values.len() == gs.len()) {
        Some(values) => {
            values
                .par_chunks_mut(SGD_CHUNK)
                .zip(gs.par_chunks(SGD_CHUNK))
                .for_each(|(p, g)| p.iter_mut().zip(g).for_each(|(p, g)| *p -= lr * g));
            param
        }
        None => {
            let param = param.to_contiguous();
            let ps: &[f32] = param.as_slice().expect("contiguous");
            let dims = param.layout().shape().clone();
            let mut out = vec![0.0f32; ps.len()];
            out.par_chunks_mut(SGD_CHUNK)
                .zip(ps.par_chunks(SGD_CHUNK).zip(gs.par_chunks(SGD_CHUNK)))
                .for_each(|(o, (p, g))| {
                    o.iter_mut().zip(p.iter().zip(g)).for_each(|(o, (p, g))| *o = p - lr * g)
                });
            FlexTensor::from_data(TensorData::new(out, dims))
        }
    }
}

/// Where output column `j` of a patch row for kernel column `kj` reads the input row: the output
/// columns `j0..j1` whose input column `j + kj - padding` lies inside `0..w`.
fn inside_columns(w: usize, wo: usize, kj: usize, padding: usize) -> (usize, usize) {
    (padding.saturating_sub(kj).min(wo), (w + padding).saturating_sub(kj).min(wo))
}

/// Input row of output row `i` for kernel row `ki`, if inside the image.
fn input_row(i: usize, ki: usize, padding: usize, h: usize) -> Option<usize> {
    (i + ki).checked_sub(padding).filter(|&y| y < h)
}

impl CpuTrainOps for Flex {
    fn sgd_step(param: FlexTensor, grad: FlexTensor, lr: f64) -> FlexTensor {
        flex_sgd_step(param, grad, lr)
    }

    fn max_pool_2x2(x: FlexTensor, relu: bool) -> FlexTensor {
        flex_max_pool_2x2(x, relu)
    }

    fn max_pool_2x2_backward(
        x: FlexTensor,
        pooled: FlexTensor,
        grad: FlexTensor,
        relu: bool,
    ) -> FlexTensor {
        flex_max_pool_2x2_backward(x, pooled, grad, relu)
    }

    fn patches(x: FlexTensor, k: usize, padding: usize) -> FlexTensor {
        let (x, [b, c, h, w]) = values_of(&x);
        let xs: &[f32] = x.as_slice().expect("contiguous");
        let (ho, wo) = output_size([h, w], k, padding);
        let rows = c * k * k;
        let mut out = vec![0.0f32; b * rows * ho * wo];
        out.par_chunks_mut(ho * wo).with_min_len(MIN_ROWS_PER_TASK).enumerate().for_each(
            |(at, row)| {
                let (bi, r) = (at / rows, at % rows);
                let (ch, ki, kj) = (r / (k * k), r / k % k, r % k);
                let plane = &xs[(bi * c + ch) * h * w..][..h * w];
                let (j0, j1) = inside_columns(w, wo, kj, padding);
                for (i, dst) in row.chunks_exact_mut(wo).enumerate() {
                    if let Some(y) = input_row(i, ki, padding, h) {
                        let from = y * w + j0 + kj - padding;
                        dst[j0..j1].copy_from_slice(&plane[from..from + (j1 - j0)]);
                    }
                }
            },
        );
        FlexTensor::from_data(TensorData::new(out, Shape::new([b, rows, ho * wo])))
    }

    fn add_patches(patches: FlexTensor, dims: [usize; 4], k: usize, padding: usize) -> FlexTensor {
        let [b, c, h, w] = dims;
        let patches = patches.to_contiguous();
        let ps: &[f32] = patches.as_slice().expect("contiguous");
        let (ho, wo) = output_size([h, w], k, padding);
        let rows = c * k * k;
        let mut dx = vec![0.0f32; b * c * h * w];
        dx.par_chunks_mut(h * w).enumerate().for_each(|(plane_at, plane)| {
            let (bi, ch) = (plane_at / c, plane_at % c);
            for ki in 0..k {
                for kj in 0..k {
                    let row = &ps[(bi * rows + (ch * k + ki) * k + kj) * ho * wo..][..ho * wo];
                    let (j0, j1) = inside_columns(w, wo, kj, padding);
                    for (i, src) in row.chunks_exact(wo).enumerate() {
                        if let Some(y) = input_row(i, ki, padding, h) {
                            let to = y * w + j0 + kj - padding;
                            for (d, s) in plane[to..to + (j1 - j0)].iter_mut().zip(&src[j0..j1]) {
                                *d += s;
                            }
                        }
                    }
                }
            }
        });
        flex_tensor(dx, dims)
    }
}

impl<B: Backend + CpuTrainOps, C: CheckpointStrategy> CpuTrainOps for Autodiff<B, C> {
    fn max_pool_2x2(x: FloatTensor<Self>, relu: bool) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct MaxPool2x2(bool);

        impl<B: Backend + CpuTrainOps> Backward<B, 1> for MaxPool2x2 {
            type State = (FloatTensor<B>, FloatTensor<B>);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (x, pooled) = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |grad| {
                    B::max_pool_2x2_backward(x, pooled, grad, self.0)
                });
            }
        }

        let input = x.node();
        let x = x.into_primitive();
        let pooled = B::max_pool_2x2(x.clone(), relu);
        match MaxPool2x2(relu).prepare::<C>([input]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, pooled.clone()), pooled),
            OpsKind::UnTracked(prep) => prep.finish(pooled),
        }
    }

    fn max_pool_2x2_backward(
        x: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        relu: bool,
    ) -> FloatTensor<Self> {
        // A gradient of a gradient is never asked for in training: computed, not tracked.
        let dx = B::max_pool_2x2_backward(
            x.into_primitive(),
            pooled.into_primitive(),
            grad.into_primitive(),
            relu,
        );
        <Self as AutodiffBackend>::from_inner(dx)
    }

    fn conv2d_by_patches(
        x: FloatTensor<Self>,
        kernels: FloatTensor<Self>,
        padding: usize,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct ConvByPatches;

        impl<B: Backend + CpuTrainOps> Backward<B, 2> for ConvByPatches {
            /// The input, the kernels as `[1, out, channels·k·k]`, the padding.
            type State = (FloatTensor<B>, FloatTensor<B>, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (x, kernels, padding) = ops.state;
                let [node_x, node_kernels] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let asked = [node_x.is_some(), node_kernels.is_some()];
                let (dx, dk) = conv2d_by_patches_backward::<B>(&x, &kernels, grad, padding, asked);
                if let (Some(node), Some(dx)) = (node_x, dx) {
                    grads.register::<B>(node.id, dx);
                }
                if let (Some(node), Some(dk)) = (node_kernels, dk) {
                    grads.register::<B>(node.id, dk);
                }
            }
        }

        let nodes = [x.node(), kernels.node()];
        let (x, kernels) = (x.into_primitive(), kernels.into_primitive());
        let [o, c, k, _] = kernels.shape().dims::<4>();
        let kernels = B::float_reshape(kernels, Shape::new([1, o, c * k * k]));
        let out = conv2d_by_groups::<B>(&x, &kernels, padding);
        match ConvByPatches.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish((x, kernels, padding), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn sgd_step(param: FloatTensor<Self>, grad: FloatTensor<Self>, lr: f64) -> FloatTensor<Self> {
        // Optimizers step the parameters' values, outside the graph.
        let stepped = B::sgd_step(param.into_primitive(), grad.into_primitive(), lr);
        <Self as AutodiffBackend>::from_inner(stepped)
    }

    fn patches(x: FloatTensor<Self>, k: usize, padding: usize) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::patches(x.into_primitive(), k, padding))
    }

    fn add_patches(
        patches: FloatTensor<Self>,
        dims: [usize; 4],
        k: usize,
        padding: usize,
    ) -> FloatTensor<Self> {
        let dx = B::add_patches(patches.into_primitive(), dims, k, padding);
        <Self as AutodiffBackend>::from_inner(dx)
    }
}

/// `param - lr · grad`; see [`CpuTrainOps::sgd_step`].
pub fn sgd_step<const D: usize>(param: Tensor<D>, grad: Tensor<D>, lr: f64) -> Tensor<D> {
    Tensor::from_dispatch(<burn::backend::Dispatch as CpuTrainOps>::sgd_step(
        param.into_dispatch(),
        grad.into_dispatch(),
        lr,
    ))
}

/// `x` `[batch, channels, h, w]` convolved with `kernels` `[out, channels, k, k]`, stride 1,
/// `padding` zeros on every side, no bias; see [`CpuTrainOps::conv2d_by_patches`].
pub fn conv2d_by_patches(x: Tensor<4>, kernels: Tensor<4>, padding: usize) -> Tensor<4> {
    Tensor::from_dispatch(<burn::backend::Dispatch as CpuTrainOps>::conv2d_by_patches(
        x.into_dispatch(),
        kernels.into_dispatch(),
        padding,
    ))
}
