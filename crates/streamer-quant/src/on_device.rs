//! Quantized tensors on a device, dequantized there into bf16 Candle
//! tensors: on the CPU by this crate's reference code, on a GPU by the
//! kernels of `kernels/src/dequant.cu` (the same bits). A tensor moves to
//! the device in its packed form ([`Dequantize::upload`]); only the
//! dequantized copy is dense, made when it is needed.
use crate::{DequantizeHost, FourBit, Fp8, HostTensor, Int8Rows};
use candle_core::{Device, Result, Tensor};

/// A quantized tensor that can be made dense on a device.
pub trait Dequantize {
    /// The packed tensor on `dev`.
    fn upload(&self, dev: &Device) -> Result<Uploaded>;

    /// The tensor in bf16 on `dev`, of its shape.
    fn dequantize_on(&self, dev: &Device) -> Result<Tensor> {
        self.upload(dev)?.dequantize()
    }
}

/// A quantized tensor held on a device in its packed form.
pub enum Uploaded {
    /// On the CPU: the host tensor itself.
    Cpu(HostTensor),
    /// On a GPU: its packed bytes and scales in device memory.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::DeviceTensor>),
}

impl Uploaded {
    /// The dense bf16 tensor, on the device the packed one is on.
    pub fn dequantize(&self) -> Result<Tensor> {
        match self {
            Self::Cpu(HostTensor::FourBit(q)) => {
                Tensor::from_vec(q.dequantize_bf16(), q.shape(), &Device::Cpu)
            }
            Self::Cpu(HostTensor::Int8(q)) => {
                Tensor::from_vec(q.dequantize_bf16(), q.dims(), &Device::Cpu)
            }
            Self::Cpu(HostTensor::Fp8(q)) => {
                Tensor::from_vec(q.dequantize_bf16(), q.dims(), &Device::Cpu)
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(t) => t.dequantize(),
        }
    }
}

fn upload(host: HostTensor, dev: &Device) -> Result<Uploaded> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(Uploaded::Cuda(Box::new(crate::cuda::DeviceTensor::new(
            d, &host,
        )?))),
        Device::Cpu => Ok(Uploaded::Cpu(host)),
        other => candle_core::bail!(
            "quantized tensors dequantize on the CPU or a CUDA GPU, not {:?}",
            other.location()
        ),
    }
}

impl Dequantize for FourBit {
    fn upload(&self, dev: &Device) -> Result<Uploaded> {
        upload(HostTensor::FourBit(self.clone()), dev)
    }
}

impl Dequantize for Int8Rows {
    fn upload(&self, dev: &Device) -> Result<Uploaded> {
        upload(HostTensor::Int8(self.clone()), dev)
    }
}

impl Dequantize for Fp8 {
    fn upload(&self, dev: &Device) -> Result<Uploaded> {
        upload(HostTensor::Fp8(self.clone()), dev)
    }
}
