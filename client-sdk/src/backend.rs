//! Where training runs: wgpu when the build has it and an adapter answers, else the flex CPU
//! backend — chosen once per process, because burn's wgpu runtime is initialised only once.

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;

/// Which backend an app asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// wgpu on a hardware adapter (a GPU through Vulkan, Metal or DX12), else the CPU backend.
    /// A software adapter (Mesa's lavapipe) is not chosen here: flex trains ~20-50× faster
    /// on the same CPU (see the `train_throughput` benchmark).
    #[default]
    Auto,
    /// wgpu on whatever adapter exists, software ones included; an error when there is none.
    Wgpu,
    /// The pure-Rust flex CPU backend.
    Cpu,
}

impl FromStr for BackendChoice {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "wgpu" => Ok(BackendChoice::Wgpu),
            "cpu" | "flex" => Ok(BackendChoice::Cpu),
            other => Err(BackendError::UnknownChoice(other.to_owned())),
        }
    }
}

/// Why a backend could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// Not one of `auto`, `wgpu`, `cpu`.
    #[error("unknown backend {0:?}: expected auto, wgpu or cpu")]
    UnknownChoice(String),
    /// wgpu was asked for and none is available.
    #[error("the wgpu backend is unavailable: {0}")]
    WgpuUnavailable(String),
}

/// The backend training will use.
#[derive(Debug, Clone)]
pub struct Backend {
    /// The device to build models on (without autodiff; see [`Backend::training_device`]).
    pub device: Device,
    /// What it is, for logs and benchmark labels.
    pub kind: BackendKind,
}

/// What a [`Backend`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendKind {
    /// wgpu on the named adapter.
    Wgpu {
        /// The adapter's name and driver, as wgpu reports them.
        adapter: String,
        /// Whether the adapter is a CPU rasterizer (lavapipe/llvmpipe) rather than a GPU.
        software: bool,
    },
    /// The flex CPU backend; `fallback_reason` says why when wgpu was wanted.
    Cpu {
        /// Why wgpu was not used, when `auto` fell back.
        fallback_reason: Option<String>,
    },
}

impl Backend {
    /// The same device with automatic differentiation, for training.
    pub fn training_device(&self) -> Device {
        self.device.clone().autodiff()
    }

    /// `"wgpu"` or `"cpu"`.
    pub fn name(&self) -> &'static str {
        match self.kind {
            BackendKind::Wgpu { .. } => "wgpu",
            BackendKind::Cpu { .. } => "cpu",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            BackendKind::Wgpu { adapter, .. } => write!(f, "wgpu ({adapter})"),
            BackendKind::Cpu { fallback_reason: None } => write!(f, "cpu (flex)"),
            BackendKind::Cpu { fallback_reason: Some(why) } => {
                write!(f, "cpu (flex; {why})")
            }
        }
    }
}

/// Resolves `choice` to a backend. wgpu's adapter is probed once per process and remembered.
pub fn select(choice: BackendChoice) -> Result<Backend, BackendError> {
    let cpu = |fallback_reason| Backend {
        device: Device::flex(),
        kind: BackendKind::Cpu { fallback_reason },
    };
    match choice {
        BackendChoice::Cpu => Ok(cpu(None)),
        BackendChoice::Wgpu => wgpu().map_err(BackendError::WgpuUnavailable),
        BackendChoice::Auto => {
            let why = match wgpu() {
                Ok(b) if matches!(b.kind, BackendKind::Wgpu { software: false, .. }) => {
                    return Ok(b);
                }
                Ok(b) => {
                    format!("the only wgpu adapter is a software rasterizer, slower than flex: {b}")
                }
                Err(why) => format!("no wgpu adapter: {why}"),
            };
            tracing::info!(%why, "training on the CPU backend");
            Ok(cpu(Some(why)))
        }
    }
}

#[cfg(feature = "wgpu")]
fn wgpu() -> Result<Backend, String> {
    use std::sync::OnceLock;
    static WGPU: OnceLock<Result<Backend, String>> = OnceLock::new();
    WGPU.get_or_init(|| {
        let (device, setup) =
            Device::wgpu_options().init_with_setup().map_err(|e| e.to_string())?;
        let info = setup.adapter.get_info();
        let adapter = format!("{}, {:?}, {}", info.name, info.backend, info.driver);
        let software = info.device_type == burn::tensor::wgpu::wgpu::DeviceType::Cpu;
        Ok(Backend { device, kind: BackendKind::Wgpu { adapter, software } })
    })
    .clone()
}

#[cfg(not(feature = "wgpu"))]
fn wgpu() -> Result<Backend, String> {
    Err("this build has no wgpu support (the starling-client `wgpu` feature is off)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_unknown_ones_are_named() {
        assert_eq!("auto".parse::<BackendChoice>().unwrap(), BackendChoice::Auto);
        assert_eq!("cpu".parse::<BackendChoice>().unwrap(), BackendChoice::Cpu);
        let err = "gpu".parse::<BackendChoice>().unwrap_err();
        assert!(err.to_string().contains("\"gpu\""), "{err}");
    }

    #[test]
    fn auto_always_yields_a_backend_and_says_why_it_is_the_cpu() {
        let auto = select(BackendChoice::Auto).unwrap();
        match (&auto.kind, select(BackendChoice::Wgpu)) {
            // A GPU: auto takes it.
            (BackendKind::Wgpu { software, .. }, Ok(_)) => assert!(!software),
            // Lavapipe only (CI): auto prefers flex and says so.
            (BackendKind::Cpu { fallback_reason: Some(why) }, Ok(_)) => {
                assert!(why.contains("software rasterizer"), "{why}")
            }
            // No adapter at all: the reason is wgpu's.
            (BackendKind::Cpu { fallback_reason: Some(_) }, Err(_)) => {}
            (kind, wgpu) => panic!("auto chose {kind:?} while wgpu is {wgpu:?}"),
        }
        assert_eq!(select(BackendChoice::Cpu).unwrap().name(), "cpu");
    }
}
